"""EAGLE-3 draft heads in the ecosystem's checkpoint layout (SafeAILab/EAGLE, SpecForge, vLLM).

A head is an HF directory:

- ``config.json``: a Llama config of one decoder layer whose ``architectures`` names
  ``LlamaForCausalLMEagle3``, with ``vocab_size`` (the target's), ``draft_vocab_size`` (the
  reduced vocabulary of the head's LM head) and, optionally,
  ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the target layers whose inputs are the
  features; absent: layers 2, L/2 and L-3 of an L-layer target) and ``target_hidden_size``.
- weights (``*.safetensors``, or ``pytorch_model.bin`` as the first EAGLE-3 releases):
  ``fc.weight`` [d, 3 d_target] (the feature projection), ``midlayer.*`` (the decoder layer:
  ``input_layernorm`` for the token embedding, ``hidden_norm`` for the feature, ``self_attn``
  with q/k/v reading both, 2d wide, ``post_attention_layernorm``, ``mlp``), ``norm.weight``,
  ``lm_head.weight`` [draft_vocab, d], ``d2t`` [draft_vocab] (target id = draft id + d2t[draft
  id]) and ``t2d`` [vocab] bool (which target ids the head can propose). ``embed_tokens.weight``
  may be present; without it the head uses the target's embedding.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from specfork.errors import ModelLoadError
from specfork.models.config import ModelArchConfig

ARCHITECTURE = "LlamaForCausalLMEagle3"
ARCHITECTURES = (ARCHITECTURE, "Eagle3LlamaForCausalLM")  # the second as vLLM also accepts
NUM_FEATURE_LAYERS = 3
_LAYER_PREFIXES = ("midlayer.", "model.midlayer.", "layers.0.", "model.layers.0.")


def default_feature_layers(num_target_layers: int) -> tuple[int, ...]:
    """A low, a middle and a high layer: the inputs of layers 2, L/2 and L-3 (as EAGLE-3)."""
    return (2, num_target_layers // 2, num_target_layers - 3)


@dataclass(frozen=True, slots=True)
class Eagle3Config:
    """An EAGLE-3 head: its decoder layer's shape (``arch``, one layer, vocabulary = the
    target's), its reduced draft vocabulary, and which target layers feed it."""

    arch: ModelArchConfig
    draft_vocab_size: int
    feature_layers: tuple[int, ...] | None  # None: default_feature_layers(the target's layers)
    target_hidden_size: int

    def layers_for(self, num_target_layers: int) -> tuple[int, ...]:
        layers = self.feature_layers or default_feature_layers(num_target_layers)
        if any(not 0 <= i < num_target_layers for i in layers):
            raise ModelLoadError(f"EAGLE-3 head reads target layers {list(layers)}, but the target has "
                                 f"{num_target_layers}")
        return layers

    def to_hf_dict(self) -> dict:
        a = self.arch
        config = {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": a.hidden_size,
            "intermediate_size": a.intermediate_size,
            "num_hidden_layers": 1,
            "num_attention_heads": a.num_heads,
            "num_key_value_heads": a.num_kv_heads,
            "head_dim": a.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": a.rms_norm_eps,
            "rope_theta": a.rope_theta,
            "rope_scaling": a.rope_scaling,
            "max_position_embeddings": a.max_position_embeddings,
            "tie_word_embeddings": False,
            "vocab_size": a.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.target_hidden_size,
            "torch_dtype": "float16",
        }
        if self.feature_layers is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(self.feature_layers)}
        return config


def is_eagle3_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a directory whose config names the EAGLE-3 Llama draft architecture."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return False
    return isinstance(config, dict) and any(a in ARCHITECTURES for a in config.get("architectures") or ())


def read_eagle3_config(directory: Path) -> Eagle3Config:
    path = Path(directory) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {path}: {e}") from None
    if int(raw.get("num_hidden_layers", 1)) != 1:
        raise ModelLoadError(f"{path}: specfork runs EAGLE-3 heads of one decoder layer, this one has "
                             f"{raw['num_hidden_layers']}")
    arch = ModelArchConfig.from_hf_dict({**raw, "model_type": "llama", "num_hidden_layers": 1})
    layers = (raw.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    draft_vocab = int(raw.get("draft_vocab_size") or arch.vocab_size)
    if not 0 < draft_vocab <= arch.vocab_size:
        raise ModelLoadError(f"{path}: draft_vocab_size {draft_vocab} must be in 1..vocab_size ({arch.vocab_size})")
    return Eagle3Config(
        arch=arch,
        draft_vocab_size=draft_vocab,
        feature_layers=tuple(int(i) for i in layers) if layers else None,
        target_hidden_size=int(raw.get("target_hidden_size") or arch.hidden_size),
    )


def load_eagle3_tensors(directory: Path) -> dict[str, torch.Tensor]:
    """The head's tensors under one set of names: ``fc.weight``, ``midlayer.*``, ``norm.weight``,
    ``lm_head.weight``, ``d2t`` and, when stored, ``embed_tokens.weight`` (``t2d`` is derived
    from ``d2t``)."""
    from specfork.loading.safetensors import load_safetensors

    directory = Path(directory)
    if not any(directory.glob("*.safetensors")) and (directory / "pytorch_model.bin").is_file():
        try:
            raw = torch.load(directory / "pytorch_model.bin", map_location="cpu", weights_only=True)
        except Exception as e:  # noqa: BLE001 - any unpickling failure is a malformed checkpoint
            raise ModelLoadError(f"cannot read {directory / 'pytorch_model.bin'}: {e}") from None
    else:
        raw = load_safetensors(directory)
    tensors = {}
    for name, tensor in raw.items():
        for prefix in _LAYER_PREFIXES:
            if name.startswith(prefix):
                name = "midlayer." + name[len(prefix):]
                break
        else:
            name = name.removeprefix("model.")
        if name != "t2d":
            tensors[name] = tensor
    missing = [n for n in ("fc.weight", "norm.weight", "lm_head.weight") if n not in tensors]
    if missing:
        raise ModelLoadError(f"EAGLE-3 head {directory} lacks {', '.join(missing)}")
    return tensors


def draft_to_target(tensors: dict[str, torch.Tensor], config: Eagle3Config) -> torch.Tensor:
    """[draft_vocab] int64: the target id of each draft id (identity without ``d2t``)."""
    ids = torch.arange(config.draft_vocab_size, dtype=torch.long)
    d2t = tensors.get("d2t")
    if d2t is None:
        if config.draft_vocab_size != config.arch.vocab_size:
            raise ModelLoadError("EAGLE-3 head with a reduced draft vocabulary lacks its d2t mapping")
        return ids
    target = ids + d2t.to(torch.long)
    if target.shape != ids.shape or target.min() < 0 or target.max() >= config.arch.vocab_size:
        raise ModelLoadError("EAGLE-3 head's d2t mapping points outside the target vocabulary")
    if len(set(target.tolist())) != len(target):
        raise ModelLoadError("EAGLE-3 head's d2t mapping sends two draft ids to one target id")
    return target


def save_eagle3(directory: Path, config: Eagle3Config, tensors: dict[str, torch.Tensor],
                draft_ids: torch.Tensor, dtype: torch.dtype = torch.float16) -> None:
    """Write a head: ``tensors`` named as :func:`load_eagle3_tensors` returns them (floating
    ones stored in ``dtype``), ``draft_ids`` [draft_vocab] the target id of each draft id."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    draft_ids = draft_ids.to(torch.long).cpu()
    out = {n: (t.detach().to(dtype) if t.is_floating_point() else t.detach()).cpu().contiguous()
           for n, t in tensors.items() if n not in ("d2t", "t2d")}
    out["d2t"] = draft_ids - torch.arange(len(draft_ids))
    t2d = torch.zeros(config.arch.vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    out["t2d"] = t2d
    save_file(out, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config.to_hf_dict(), indent=2) + "\n")


def check_eagle3_head(directory: Path, target_arch) -> Eagle3Config:
    """The head's config, after refusing a head that was not made for a target of ``target_arch``
    (its vocabulary, hidden size and feature layers); reads no weights."""
    config = read_eagle3_config(directory)
    t = target_arch
    if config.arch.vocab_size != t.vocab_size:
        raise ModelLoadError(f"EAGLE-3 head {directory} is for a vocabulary of {config.arch.vocab_size} tokens, the "
                             f"target has {t.vocab_size}")
    if config.target_hidden_size != t.hidden_size or config.arch.hidden_size != t.hidden_size:
        raise ModelLoadError(f"EAGLE-3 head {directory} is for a target of hidden size {config.target_hidden_size}, "
                             f"the target has {t.hidden_size}")
    config.layers_for(t.num_layers)
    return config


def load_eagle3_head(directory: Path, target, *, device: torch.device, quantize_group: int | None = None):
    """The head in ``directory`` for ``target`` (a LoadedModel): it shares the target's
    embedding (unless the checkpoint stores its own) and runs in the target's dtype; with
    ``quantize_group`` its projections run the native int4 kernel (CPU float32)."""
    from specfork.models.eagle3 import Eagle3Head

    config = check_eagle3_head(directory, target.arch)
    tensors = load_eagle3_tensors(directory)
    draft_ids = draft_to_target(tensors, config)
    dtype = target.model.embed_tokens.weight.dtype
    embed = target.model.embed_tokens
    if "embed_tokens.weight" in tensors:
        embed = torch.nn.Embedding.from_pretrained(tensors.pop("embed_tokens.weight").to(dtype), freeze=True)
    if quantize_group is not None and device.type == "cpu" and dtype == torch.float32:
        from specfork.layers.quantized import quantize_int4

        for name, tensor in list(tensors.items()):
            if tensor.dim() == 2 and name != "d2t" and not name.endswith("norm.weight") \
                    and tensor.shape[1] % quantize_group == 0:
                tensors[name] = quantize_int4(tensor.to(dtype), quantize_group)

    def take(name: str):
        tensor = tensors.pop(name, None)
        if tensor is None or not isinstance(tensor, torch.Tensor):
            return tensor
        return tensor.to(device=device, dtype=dtype)

    try:
        head = Eagle3Head(config, take, embed, draft_ids, target.model.rotary.cos.shape[0]).to(device)
    except RuntimeError as e:
        raise ModelLoadError(f"EAGLE-3 head {directory}: tensors do not match the config: {e}") from None
    tensors.pop("d2t", None)
    if tensors:
        raise ModelLoadError(f"EAGLE-3 head {directory} has unexpected tensors: {sorted(tensors)[:3]}")
    return head.eval()

"""Load a checkpoint (alias, HF directory or GGUF file) into a model, its config and its tokenizer."""

from __future__ import annotations

import logging
import re
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from specfork.errors import MissingTensorError, ModelLoadError
from specfork.layers.quantized import QuantizedLinear
from specfork.loading.huge_pages import move_to_huge_pages
from specfork.loading.resolve import CheckpointFormat, CheckpointLocation, resolve_checkpoint
from specfork.loading.tokenizer import Tokenizer, load_gguf_tokenizer, load_hf_tokenizer
from specfork.models.config import ModelArchConfig
from specfork.models.llama import LlamaForCausalLM
from specfork.models.tensor_parallel import TensorShard

logger = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: LlamaForCausalLM
    arch: ModelArchConfig
    tokenizer: Tokenizer | None
    location: CheckpointLocation


@contextmanager
def _one_thread():
    """Loading is a few memory-bound passes over the weights: one thread does them about as fast
    as two on a quiet machine, and several times faster when other processes share the cores
    (OpenMP workers then spin at every barrier: 0.4 s vs 4 s measured for the embedded model)."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def load_model(
    model: str,
    *,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: int | None = None,
    weights: str = "fp32",
    quantize_group: int | None = None,
    with_tokenizer: bool = True,
    shard: TensorShard | None = None,
) -> LoadedModel:
    """Load ``model`` (alias, HF dir or GGUF file) onto ``device`` in ``dtype``.

    ``weights``: "native" keeps a GGUF's matrices quantised where
    :mod:`specfork.layers.gguf_blocks` has a form for their format (run by the native
    kernel on CPU in float32, activations rounded to int16), "native-int8" the same with int8
    activations; "fp32" dequantises everything at load. ``quantize_group``
    quantises the projection matrices of an HF checkpoint to 4 bits in groups of that many inputs.
    ``with_tokenizer=False`` skips the tokenizer (a drafter that only sees token ids). ``shard``:
    build only that tensor-parallel rank's part of the model (``LoadedModel.arch`` stays the
    whole model's; ``model.config`` counts the shard's heads).
    """
    with _one_thread():
        return _load(model, device=device, dtype=dtype, max_positions=max_positions, weights=weights,
                     quantize_group=quantize_group, with_tokenizer=with_tokenizer, shard=shard)


@dataclass
class Vocabulary:
    """What a checkpoint says about its tokens, read without its weights."""

    arch: ModelArchConfig
    tokenizer: Tokenizer


def load_vocabulary(model: str) -> Vocabulary:
    """The config and tokenizer of ``model`` (alias, HF dir or GGUF file), weights untouched: enough
    to check that a draft shares a target's vocabulary before anything heavy is loaded."""
    _, arch, tokenizer, _ = _read(resolve_checkpoint(model), with_tokenizer=True, native=False)
    return Vocabulary(arch, tokenizer)


def read_arch(model: str) -> ModelArchConfig:
    """The architecture of ``model`` (alias, HF dir or GGUF file) from its config alone."""
    return _read(resolve_checkpoint(model), with_tokenizer=False, native=False)[1]


def _read(location: CheckpointLocation, *, with_tokenizer: bool, native: bool):
    """(location, arch, tokenizer or None, a callable returning the tensors by name)."""
    if location.format is CheckpointFormat.GGUF:
        from specfork.loading.gguf import load_gguf_tensors, open_gguf, read_gguf_config

        reader = open_gguf(location.path)
        arch = read_gguf_config(reader, location.path)
        tokenizer = load_gguf_tokenizer(reader) if with_tokenizer else None
        return location, arch, tokenizer, lambda: load_gguf_tensors(reader, arch, location.path, native=native)
    from specfork.loading.safetensors import load_safetensors, read_hf_config

    arch = read_hf_config(location.path)
    tokenizer = load_hf_tokenizer(location.path) if with_tokenizer else None
    return location, arch, tokenizer, lambda: load_safetensors(location.path)


def _load(model: str, *, device: torch.device, dtype: torch.dtype, max_positions: int | None, weights: str,
          quantize_group: int | None, with_tokenizer: bool, shard: TensorShard | None = None) -> LoadedModel:
    location, arch, tokenizer, read_tensors = _read(
        resolve_checkpoint(model), with_tokenizer=with_tokenizer, native=weights.startswith("native")
    )
    tensors = read_tensors()
    if quantize_group is not None and location.format is CheckpointFormat.GGUF:
        logger.warning("--quantize applies to HF checkpoints; %s is a GGUF file and keeps its own quantisation",
                       location.path)
    if location.format is not CheckpointFormat.GGUF and quantize_group is not None and device.type == "cpu" \
            and dtype == torch.float32:
        from specfork.layers.quantized import quantize_int4

        for name, t in list(tensors.items()):
            if name.endswith("proj.weight") and t.dim() == 2 and t.shape[1] % quantize_group == 0:
                tensors[name] = quantize_int4(t, quantize_group)
    if weights == "native-int8":
        from specfork.layers.quantized import QuantizedWeight

        tensors = {n: replace(t, input_bits=8) if isinstance(t, QuantizedWeight) else t for n, t in tensors.items()}
    if tokenizer is not None and tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in arch.eos_token_ids:
        arch = replace(arch, eos_token_ids=arch.eos_token_ids + (tokenizer.eos_token_id,))

    def take(name: str) -> torch.Tensor | None:
        t = tensors.pop(name, None)
        return None if t is None else t.to(device=device, dtype=dtype)

    positions = max_positions or arch.max_position_embeddings
    built, reduce = arch, None
    if shard is not None:
        built, take, reduce = shard.local_arch(arch), shard.source(take, arch), shard.reduce
    try:
        net = LlamaForCausalLM(built, take, positions, reduce).to(device)
    except MissingTensorError as e:
        from specfork.loading.gguf import gguf_name

        spelled = gguf_name(e.name) if location.format is CheckpointFormat.GGUF else e.name
        raise ModelLoadError(f"{location.path} lacks the tensor {spelled or e.name!r}, which a "
                             f"{arch.architecture} model of this config needs") from None
    except RuntimeError as e:  # shape mismatches between config and tensors
        raise ModelLoadError(f"{location.path}: tensors do not match the config: {e}") from None
    _check_shapes(net, built, location)
    leftover = [n for n in tensors if not n.endswith("rotary_emb.inv_freq")]
    _check_no_more_layers(leftover, arch, location)
    if leftover:
        logger.warning("ignored %d unexpected tensors, e.g. %s", len(leftover), leftover[:3])
    _warn_of_non_finite_weights(net, location)
    net.eval()
    quantized_to_huge_pages(net)
    return LoadedModel(net, arch, tokenizer, location)


_LAYER_INDEX = re.compile(r"model\.layers\.(\d+)\.")


def _check_shapes(net: LlamaForCausalLM, arch: ModelArchConfig, location: CheckpointLocation) -> None:
    emb = net.embed_tokens.weight.shape
    if emb[1] != arch.hidden_size or emb[0] < arch.vocab_size:
        raise ModelLoadError(f"{location.path}: embedding shape {tuple(emb)} does not match the config")
    attn = net.layers[0].self_attn
    expected = (arch.num_heads + 2 * arch.num_kv_heads) * arch.head_dim
    if attn.qkv_proj.out_features != expected or attn.qkv_proj.in_features != arch.hidden_size:
        raise ModelLoadError(f"{location.path}: attention weights do not match the config")
    mlp = net.layers[0].mlp
    if mlp.gate_up_proj.out_features != 2 * arch.intermediate_size or mlp.down_proj.in_features != arch.intermediate_size:
        raise ModelLoadError(f"{location.path}: the MLP weights have {mlp.down_proj.in_features} units where the "
                             f"config says intermediate_size {arch.intermediate_size}")


def _warn_of_non_finite_weights(net: torch.nn.Module, location: CheckpointLocation) -> None:
    """A checkpoint with NaN or infinite weights (or quantisation scales) loads, as transformers
    loads it, but what it generates is noise: said once, naming the tensors."""
    # one sum per tensor: NaN and infinities carry through it (finite weights do not overflow
    # float32); a dense layer's ``packed`` copy (the native kernel's layout) repeats its weight
    bad = [name for name, t in net.named_parameters() if t.is_floating_point() and not name.endswith(".packed")
           and not bool(torch.isfinite(t.sum(dtype=torch.float32)))]
    if bad:
        logger.warning("%s: %d weight tensors hold NaN or infinite values (%s%s); the outputs will be meaningless",
                       location.path, len(bad), ", ".join(bad[:3]), ", ..." if len(bad) > 3 else "")


def _check_no_more_layers(leftover: list[str], arch: ModelArchConfig, location: CheckpointLocation) -> None:
    """Weights of layers past the config's count: the config describes another model (running its
    first layers only would give wrong numbers)."""
    extra = {index for n in leftover if (m := _LAYER_INDEX.match(n)) and (index := int(m.group(1))) >= arch.num_layers}
    if extra:
        raise ModelLoadError(f"{location.path}: the checkpoint has weights for {max(extra) + 1} layers but the config "
                             f"says {arch.num_layers} (num_hidden_layers, or block_count in a GGUF)")


def packed_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """The packed weights of ``model``'s native quantised projections, in module order: what
    every decode step streams."""
    layers = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    return [t for m in layers for t in (m.values, m.scales, m.offsets)]


def quantized_to_huge_pages(model: torch.nn.Module) -> None:
    """``model``'s packed weights onto 2 MB pages (loading/huge_pages.py; nothing changes where
    Linux has none)."""
    moved = move_to_huge_pages(packed_weights(model))
    if moved:
        logger.info("quantised weights: %.1f MB on 2 MB pages", moved / 1e6)

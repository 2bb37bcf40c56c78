"""The architecture description every model and loader shares."""

from __future__ import annotations

from dataclasses import dataclass

from specfork.errors import ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True, slots=True)
class ModelArchConfig:
    """A decoder-only transformer of the Llama family.

    qkv_bias: Qwen2-style biases on q/k/v projections. qk_norm: Qwen3-style RMSNorm on q and k
    per head before RoPE.
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    rope_scaling: dict | None = None
    qkv_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.architecture not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported architecture {self.architecture!r}; specfork runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        if self.num_heads % self.num_kv_heads:
            raise ModelLoadError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of num_key_value_heads ({self.num_kv_heads})"
            )

    @classmethod
    def from_hf_dict(cls, cfg: dict) -> "ModelArchConfig":
        """Build from an HF ``config.json`` dictionary."""
        model_type = cfg.get("model_type")
        if model_type not in SUPPORTED_ARCHITECTURES:
            raise ModelLoadError(
                f"unsupported model_type {model_type!r} in config.json; specfork runs {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        _refuse_unsupported_features(cfg, model_type)

        def number(key: str, default: object = _REQUIRED, *, kind: type = int):
            value = cfg.get(key)
            if value is None:
                if default is _REQUIRED:
                    raise ModelLoadError(f"config.json lacks the field {key!r}")
                value = default
            if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and value != int(value)):
                raise ModelLoadError(f"config.json: {key} must be {'an integer' if kind is int else 'a number'}, "
                                     f"got {value!r}")
            if not value > 0:
                raise ModelLoadError(f"config.json: {key} must be positive, got {value!r}")
            return kind(value)

        heads = number("num_attention_heads")
        hidden = number("hidden_size")
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
        rope_parameters = cfg.get("rope_parameters") if isinstance(cfg.get("rope_parameters"), dict) else {}
        return cls(
            architecture=model_type,
            vocab_size=number("vocab_size"),
            hidden_size=hidden,
            intermediate_size=number("intermediate_size"),
            num_layers=number("num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=number("num_key_value_heads", heads),
            head_dim=number("head_dim", hidden // heads),
            rms_norm_eps=number("rms_norm_eps", 1e-6, kind=float),
            rope_theta=number("rope_theta", rope_parameters.get("rope_theta", 10000.0), kind=float),
            max_position_embeddings=number("max_position_embeddings", 2048),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            rope_scaling=_rope_scaling(cfg),
            qkv_bias=model_type == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=model_type == "qwen3",
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


_REQUIRED = object()


def _refuse_unsupported_features(cfg: dict, model_type: str) -> None:
    """Settings of these architectures that the model does not implement: refused, never run
    without them (the logits would be silently wrong)."""
    act = cfg.get("hidden_act", cfg.get("hidden_activation", "silu"))
    if act not in ("silu", "swish"):
        raise ModelLoadError(f"config.json: hidden_act {act!r} is not supported (specfork's MLP uses SiLU)")
    if cfg.get("mlp_bias"):
        raise ModelLoadError("config.json: mlp_bias is not supported (biases on the MLP projections)")
    if cfg.get("partial_rotary_factor") not in (None, 1, 1.0):
        raise ModelLoadError("config.json: partial_rotary_factor is not supported (RoPE on part of each head)")
    window, context = cfg.get("sliding_window"), cfg.get("max_position_embeddings")
    if isinstance(window, int) and isinstance(context, int) and 0 < window < context:
        layers = cfg.get("layer_types")
        if isinstance(layers, list):  # transformers' per-layer spelling
            windowed = "sliding_attention" in layers
        elif model_type == "mistral":
            windowed = True
        else:  # Qwen: the window applies from layer max_window_layers on
            windowed = bool(cfg.get("use_sliding_window")) and \
                cfg.get("max_window_layers", 0) < cfg.get("num_hidden_layers", 0)
        if windowed:
            raise ModelLoadError(f"{model_type} models with a sliding window shorter than the context are not "
                                 f"supported (sliding_window {window}, max_position_embeddings {context})")


def _rope_scaling(cfg: dict) -> dict | None:
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters")
    if not scaling:
        return None
    if not isinstance(scaling, dict):
        raise ModelLoadError(f"config.json: rope_scaling must be an object, got {scaling!r}")
    kind = scaling.get("rope_type", scaling.get("type"))
    if kind in (None, "default"):
        return None
    if kind not in ("llama3", "linear"):
        raise ModelLoadError(f"unsupported rope_scaling type {kind!r} (supported: llama3, linear)")
    return dict(scaling)

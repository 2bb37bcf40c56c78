"""Load HF model directories: config.json plus single or sharded safetensors."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from specfork.errors import ModelLoadError
from specfork.models.config import ModelArchConfig


def read_hf_config(directory: Path) -> ModelArchConfig:
    try:
        cfg = json.loads((directory / "config.json").read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ModelLoadError(f"cannot read {directory / 'config.json'}: {e}") from None
    if not isinstance(cfg, dict):
        raise ModelLoadError(f"{directory / 'config.json'} is not a JSON object")
    arch = ModelArchConfig.from_hf_dict(cfg)
    gen = directory / "generation_config.json"
    if gen.is_file():
        try:
            eos = json.loads(gen.read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError):
            eos = None
        if eos is not None:
            extra = tuple(eos) if isinstance(eos, list) else (int(eos),)
            merged = tuple(dict.fromkeys(arch.eos_token_ids + extra))
            arch = _replace_eos(arch, merged)
    return arch


def _replace_eos(arch: ModelArchConfig, eos: tuple[int, ...]) -> ModelArchConfig:
    from dataclasses import replace

    return replace(arch, eos_token_ids=eos)


def safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, KeyError, json.JSONDecodeError) as e:
            raise ModelLoadError(f"malformed {index}: {e}") from None
        files = [directory / name for name in dict.fromkeys(weight_map.values())]
    else:
        files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{directory} has no *.safetensors weights")
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise ModelLoadError(f"safetensors shards listed in the index are missing: {', '.join(missing)}")
    return files


def load_safetensors(directory: Path) -> dict[str, torch.Tensor]:
    """All tensors of the directory's checkpoint, on CPU in their stored dtype."""
    tensors: dict[str, torch.Tensor] = {}
    for file in safetensors_files(directory):
        try:
            with safe_open(str(file), framework="pt") as f:
                for name in f.keys():
                    tensors[name] = f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError, ValueError) as e:
            raise ModelLoadError(f"malformed safetensors file {file}: {e}") from None
    return tensors

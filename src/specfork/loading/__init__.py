"""Checkpoint loading: HF directories and GGUF files → a model, its config and its tokenizer.

``load_model`` and ``LoadedModel`` live in :mod:`specfork.loading.loader`; they are imported on
first use so that light users of this package (the CLI's option tables) do not import torch."""

from specfork.loading.resolve import CheckpointLocation, resolve_checkpoint

__all__ = ["LoadedModel", "Vocabulary", "load_model", "load_vocabulary", "resolve_checkpoint", "CheckpointLocation"]


def __getattr__(name: str):
    if name in ("LoadedModel", "Vocabulary", "load_model", "load_vocabulary"):
        from specfork.loading import loader

        return getattr(loader, name)
    raise AttributeError(f"module 'specfork.loading' has no attribute {name!r}")

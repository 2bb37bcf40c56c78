"""Which draft checkpoint a speculative engine uses, and the one way every caller loads it (the
SD proposer, SSD's drafter process and SSD's in-process fallback)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.config import Config
from specfork.errors import ModelLoadError
from specfork.loading import LoadedModel, Vocabulary, load_model, load_vocabulary
from specfork.loading.resolve import resolve_draft


@dataclass(frozen=True, slots=True)
class DraftSpec:
    """Everything needed to load the draft anywhere (it is sent to the drafter process)."""

    path: str
    dtype: str  # torch dtype name, the target's
    max_positions: int  # the target's RoPE table length
    load_options: dict
    target: str  # the target's checkpoint (an EAGLE-3 head shares its embedding)


def draft_spec(config: Config, target: LoadedModel) -> DraftSpec:
    """The draft for ``target`` as configured (``config.draft``, or the first shipped draft)."""
    return DraftSpec(
        path=resolve_draft(config.draft, target.location),
        dtype=str(target.model.embed_tokens.weight.dtype).removeprefix("torch."),
        max_positions=target.model.rotary.cos.shape[0],
        load_options=config.load_options,
        target=str(target.location.path),
    )


def load_draft(spec: DraftSpec, device: torch.device, target: LoadedModel | None = None) -> LoadedModel:
    """Load the draft on ``device``; with ``target``, refuse one that does not share its vocabulary.
    Without it (the drafter process, which sees token ids only) no tokenizer is loaded."""
    draft = load_model(spec.path, device=device, dtype=getattr(torch, spec.dtype), max_positions=spec.max_positions,
                       with_tokenizer=target is not None, **spec.load_options)
    if target is not None:
        check_vocabularies(target, draft)
    return draft


def load_drafter(spec: DraftSpec, device: torch.device):
    """What SSD's drafter process drafts with: the draft model, or the EAGLE-3 head (with the
    target's embedding: the target is read for it, and everything else of it dropped)."""
    if not is_head(spec):
        return load_draft(spec, device).model
    target = load_model(spec.target, device=device, dtype=getattr(torch, spec.dtype), max_positions=spec.max_positions,
                        with_tokenizer=False, **spec.load_options)
    return load_head(spec, device, target)


def is_head(spec: DraftSpec) -> bool:
    """Whether the draft is an EAGLE-3 head (it reads the target's features) rather than a model."""
    from pathlib import Path

    from specfork.loading.eagle3 import is_eagle3_checkpoint

    return is_eagle3_checkpoint(Path(spec.path))


def load_head(spec: DraftSpec, device: torch.device, target: LoadedModel):
    """The EAGLE-3 head for ``target`` (it shares the target's embedding, so it loads where the
    target is)."""
    from specfork.loading.eagle3 import load_eagle3_head

    options = spec.load_options
    # A head's step must cost a small fraction of a target step: under native weights its
    # projections run the int4 kernel (groups of 32 unless --quantize-group says otherwise; int16
    # activations under native-int8 too).
    group = options["quantize_group"] or (32 if options["weights"].startswith("native") else None)
    return load_eagle3_head(spec.path, target, device=device, quantize_group=group)


def check_draft_vocabulary(spec: DraftSpec, target: LoadedModel) -> None:
    """``check_vocabularies`` without loading the draft's weights."""
    check_vocabularies(target, load_vocabulary(spec.path))


def check_vocabularies(target: LoadedModel | Vocabulary, draft: LoadedModel | Vocabulary) -> None:
    """Refuse a draft that does not map the target's token ids to the same tokens. A draft whose
    embedding is padded beyond the target's vocabulary is fine (extra ids are never proposed)."""
    tv, dv = target.arch.vocab_size, draft.arch.vocab_size
    if dv < tv:
        raise ModelLoadError(f"draft vocabulary ({dv} tokens) is smaller than the target's ({tv})")
    if target.tokenizer is not None and draft.tokenizer is not None:
        t_vocab = target.tokenizer.vocab
        d_vocab = draft.tokenizer.vocab
        mismatched = [tok for tok, i in t_vocab.items() if i < tv and d_vocab.get(tok) != i]
        if mismatched:
            raise ModelLoadError(
                f"draft and target tokenizers differ ({len(mismatched)} tokens map to other ids, e.g. "
                f"{mismatched[:3]}); a draft must share the target's vocabulary"
            )

"""Build the SD step for an engine from its config."""

from __future__ import annotations

from specfork.engine.llm_engine import LLMEngine
from specfork.errors import SpecforkError
from specfork.loading import load_model
from specfork.spec.draft_model import DraftModelProposer, check_vocabularies
from specfork.spec.ngram import NgramProposer
from specfork.spec.step import SpeculativeStep


def build_speculative_step(engine: LLMEngine) -> SpeculativeStep:
    config = engine.config
    if config.drafter == "ngram":
        proposer = NgramProposer(min_n=config.ngram_min, max_n=config.ngram_max)
    else:
        if config.draft is None:
            raise SpecforkError("SD with drafter 'draft' needs a draft model: pass draft=PATH (--draft PATH)")
        target = engine.loaded
        draft = load_model(
            config.draft,
            device=engine.device,
            dtype=target.model.embed_tokens.weight.dtype,
            max_positions=target.model.rotary.cos.shape[0],
        )
        check_vocabularies(target, draft)
        proposer = DraftModelProposer(
            draft,
            vocab_size=target.arch.vocab_size,
            num_blocks=engine.num_kv_blocks,
            block_size=config.block_size,
            device=engine.device,
        )
    return SpeculativeStep(engine.runner, proposer, k=config.k, max_model_len=engine.max_model_len)

"""Build the speculative step (SD or SSD) for an engine from its config."""

from __future__ import annotations

import logging
import os
from pathlib import Path

from specfork.engine.llm_engine import LLMEngine
from specfork.errors import SpecforkError
from specfork.loading.eagle3 import check_eagle3_head
from specfork.loading.resolve import resolve_corpus
from specfork.speculative.corpus import LookupCorpus, load_corpus
from specfork.speculative.draft_loading import (
    check_draft_vocabulary,
    draft_spec,
    is_head,
    load_draft,
    load_head,
)
from specfork.speculative.draft_model import DraftModelProposer
from specfork.speculative.eagle3_proposer import Eagle3Proposer
from specfork.speculative.lookup_first import LookupFirstProposer
from specfork.speculative.ngram import NgramProposer
from specfork.speculative.sd_step import SpeculativeStep

logger = logging.getLogger(__name__)


def build_speculative_step(engine: LLMEngine) -> SpeculativeStep:
    config = engine.config
    corpus = _lookup_corpus(engine) if config.prompt_lookup else None
    if config.drafter == "ngram":
        proposer = NgramProposer(min_n=config.ngram_min, max_n=config.ngram_max, corpus=corpus,
                                 corpus_tokens=config.corpus_tokens)
    else:
        proposer = _proposer(engine, draft_spec(config, engine.loaded))
        if config.lookup_first_n:
            proposer = LookupFirstProposer(proposer, min_n=config.lookup_first_n, max_n=config.ngram_max,
                                           corpus=corpus, corpus_tokens=config.corpus_tokens)
    auto_k = None
    if config.auto_k:
        from specfork.speculative.auto_k import AutoK, measure_step_costs

        draft_s = 0.0 if config.drafter == "ngram" else proposer.draft_step_seconds()
        auto_k = AutoK(measure_step_costs(engine.runner, engine.block_manager, draft_s, engine.max_model_len))
    return SpeculativeStep(engine.runner, proposer, k=config.k_max, max_model_len=engine.max_model_len, auto_k=auto_k,
                           decode_steps=config.decode_steps)


def _lookup_corpus(engine: LLMEngine) -> LookupCorpus | None:
    path = resolve_corpus(engine.config.lookup_corpus, engine.loaded.location)
    if path is None:
        return None
    corpus = load_corpus(path, engine.loaded.arch.vocab_size)
    logger.info("prompt lookup also searches %s (%d tokens of the target's responses)", path, len(corpus))
    return corpus


def _proposer(engine: LLMEngine, spec) -> DraftModelProposer | Eagle3Proposer:
    """The in-process proposer for the draft ``spec`` (SD's, and SSD's fallback)."""
    if is_head(spec):
        return _head_proposer(engine, spec)
    if engine.config.draft_confidence is not None:
        raise SpecforkError(f"--draft-confidence is the confidence floor of an EAGLE-3 head's chains; the draft "
                            f"{spec.path} is a draft model, whose chains run to k")
    return _draft_proposer(engine, load_draft(spec, engine.device, target=engine.loaded))


def _draft_proposer(engine: LLMEngine, draft) -> DraftModelProposer:
    return DraftModelProposer(draft.model, vocab_size=engine.loaded.arch.vocab_size, num_blocks=engine.num_kv_blocks,
                              block_size=engine.config.block_size, device=engine.device,
                              cuda_graphs=engine.config.cuda_graphs, max_seqs=engine.config.max_num_seqs,
                              max_rows=engine.config.k_max + 1)


def _head_proposer(engine: LLMEngine, spec) -> Eagle3Proposer:
    head = load_head(spec, engine.device, engine.loaded)
    return Eagle3Proposer(
        head, feature_layers=head.head_config.layers_for(engine.loaded.arch.num_layers),
        vocab_size=engine.loaded.arch.vocab_size, num_blocks=engine.num_kv_blocks, block_size=engine.config.block_size,
        device=engine.device, min_confidence=engine.config.head_confidence,
        cuda_graphs=engine.config.cuda_graphs, max_seqs=engine.config.max_num_seqs,
        prefix_caching=engine.config.prefix_caching,
    )


def build_ssd_step(engine: LLMEngine, drafter=None) -> SpeculativeStep:
    """SSD: the same verification step, fed by a drafter process (see ``speculative/ssd``). ``drafter``:
    a :class:`DrafterProcess` started earlier and not yet launched (None starts one now, or, with
    ``drafter_rank``, talks to that rank of the engine's world). The in-process fallback draft is
    loaded only if the drafter fails."""
    import torch

    from specfork.speculative.ssd.cores import TargetPinning, core_sharing_warning, split_cores
    from specfork.speculative.ssd.messages import DrafterLaunch
    from specfork.speculative.ssd.proposer import SSDProposer

    config = engine.config
    if config.drafter != "draft":
        raise SpecforkError("SSD needs a draft model (drafter 'draft'); n-gram lookup has nothing to pre-draft")
    spec = draft_spec(config, engine.loaded)
    head = None
    if is_head(spec):
        if config.tree_backend != "fast":
            raise SpecforkError(f"--tree-backend {config.tree_backend} runs draft models only; an EAGLE-3 head "
                                "pre-drafts with --tree-backend fast")
        head = check_eagle3_head(Path(spec.path), engine.loaded.arch)  # before the drafter process loads it
    else:
        check_draft_vocabulary(spec, engine.loaded)
    if config.drafter_rank is not None:
        from specfork.speculative.ssd.transport import DrafterRank

        drafter = DrafterRank(engine.world, config.drafter_rank)
    drafter_device = config.drafter_device
    if drafter_device is None and config.drafter_rank is not None and engine.device.type == "cuda":
        drafter_device = engine.world.plan.device_of(config.drafter_rank)  # the GPU after the shards'
    if drafter_device is None:
        if engine.device.type == "cuda" and torch.cuda.device_count() > 1:
            drafter_device = f"cuda:{((engine.device.index or 0) + 1) % torch.cuda.device_count()}"
        else:
            drafter_device = str(engine.device)
    local = config.distributed_launch == "local"  # under torchrun the drafter may be on another host
    both_on_cpu = engine.device.type == "cpu" and drafter_device == "cpu"
    target_cores, drafter_cores = split_cores(config, both_on_cpu) if local else (None, None)
    if engine.device.type == "cpu":
        warning = core_sharing_warning(target_cores, len(os.sched_getaffinity(0)))
        if warning:
            logger.warning(warning)
    launch = DrafterLaunch(
        draft=spec,
        settings=_drafter_settings(engine),
        device=drafter_device,
        threads=len(drafter_cores) if drafter_cores else max(1, torch.get_num_threads()),
        cores=drafter_cores if drafter_device == "cpu" else None,
        seed=config.seed,
    )
    proposer = SSDProposer(
        launch,
        drafter=drafter,
        vocab_size=engine.loaded.arch.vocab_size,
        device=engine.device,
        timeout_s=config.drafter_timeout_s,
        fallback=lambda: _proposer(engine, spec),
        pin_target=TargetPinning(target_cores if engine.device.type == "cpu" else None, config.threads),
        feature_layers=() if head is None else head.layers_for(engine.loaded.arch.num_layers),
    )
    return SpeculativeStep(engine.runner, proposer, k=config.k, max_model_len=engine.max_model_len)


def _drafter_settings(engine: LLMEngine):
    """The drafter's tree shape and a KV cache big enough for every sequence's trunk and branches."""
    from specfork.speculative.ssd.messages import DrafterSettings

    config = engine.config
    hit, miss = config.fan_out_lists
    width = sum(hit)
    blocks_per_seq = (
        -(-(config.k + 1 + config.k * width) // config.block_size)  # glue + sdpa scratch
        + width * (-(-config.k // config.block_size) + 1)  # paged branches
    )
    return DrafterSettings(
        k=config.k,
        fanout_hit=hit,
        fanout_miss=miss,
        backup=config.backup,
        tree_backend=config.tree_backend,
        saguaro=config.saguaro_x,
        block_size=config.block_size,
        num_blocks=engine.num_kv_blocks + config.max_num_seqs * blocks_per_seq,
        vocab_size=engine.loaded.arch.vocab_size,
    )

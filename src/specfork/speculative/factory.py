"""Build the SD step for an engine from its config."""

from __future__ import annotations

from specfork.engine.llm_engine import LLMEngine
from specfork.errors import SpecforkError
from specfork.loading import load_model
from specfork.loading.resolve import resolve_draft
from specfork.speculative.draft_model import DraftModelProposer, check_vocabularies
from specfork.speculative.ngram import NgramProposer
from specfork.speculative.sd_step import SpeculativeStep


def build_speculative_step(engine: LLMEngine) -> SpeculativeStep:
    config = engine.config
    if config.drafter == "ngram":
        proposer = NgramProposer(min_n=config.ngram_min, max_n=config.ngram_max)
    else:
        target = engine.loaded
        draft = load_model(
            resolve_draft(config.draft, target.location),
            device=engine.device,
            dtype=target.model.embed_tokens.weight.dtype,
            max_positions=target.model.rotary.cos.shape[0],
            **config.load_options,
        )
        check_vocabularies(target, draft)
        proposer = DraftModelProposer(
            draft,
            vocab_size=target.arch.vocab_size,
            num_blocks=engine.num_kv_blocks,
            block_size=config.block_size,
            device=engine.device,
        )
    auto_k = None
    if config.auto_k:
        from specfork.speculative.auto_k import K_MAX, AutoK, StepCosts, measure_forward

        verify = tuple(measure_forward(engine.runner, engine.block_manager, m) for m in range(1, K_MAX + 2))
        draft_s = 0.0 if config.drafter == "ngram" else measure_forward(proposer.runner, proposer.blocks, 1)
        auto_k = AutoK(StepCosts(draft_s, verify))
    return SpeculativeStep(engine.runner, proposer, k=config.k_max, max_model_len=engine.max_model_len, auto_k=auto_k)


def build_ssd_step(engine: LLMEngine, drafter=None) -> SpeculativeStep:
    """SSD: the same verification step, fed by a drafter process (see ``speculative/ssd``). ``drafter``:
    a :class:`DrafterProcess` started earlier and not yet launched (None starts one now)."""
    import os

    import torch

    from specfork.speculative.ssd.drafter import DrafterSettings
    from specfork.speculative.ssd.proposer import SSDProposer
    from specfork.speculative.ssd.worker import DrafterLaunch

    config = engine.config
    if config.drafter != "draft":
        raise SpecforkError("SSD needs a draft model (drafter 'draft'); n-gram lookup has nothing to pre-draft")
    target = engine.loaded
    draft_path = resolve_draft(config.draft, target.location)
    dtype = target.model.embed_tokens.weight.dtype
    positions = target.model.rotary.cos.shape[0]
    draft = load_model(draft_path, device=engine.device, dtype=dtype, max_positions=positions, **config.load_options)
    check_vocabularies(target, draft)

    target_cores, drafter_cores = _split_cores(config)
    previous = (os.sched_getaffinity(0), torch.get_num_threads())

    def pin_target(on: bool) -> None:
        """The target on its own cores while a drafter process runs on the others; on all of
        them again while none does."""
        if engine.device.type != "cpu" or target_cores is None:
            return
        if on:
            os.sched_setaffinity(0, target_cores)
            torch.set_num_threads(config.threads or len(target_cores))
        else:
            os.sched_setaffinity(0, previous[0])
            torch.set_num_threads(previous[1])

    drafter_device = config.drafter_device
    if drafter_device is None:
        if engine.device.type == "cuda" and torch.cuda.device_count() > 1:
            drafter_device = f"cuda:{(engine.device.index or 0) + 1}"
        else:
            drafter_device = str(engine.device)
    hit, miss = config.fan_out_lists
    width = sum(hit)
    blocks_per_seq = (
        -(-(config.k + 1 + config.k * width) // config.block_size)  # glue + sdpa scratch
        + width * (-(-config.k // config.block_size) + 1)  # paged branches
    )
    settings = DrafterSettings(
        k=config.k,
        fanout_hit=hit,
        fanout_miss=miss,
        backup=config.backup,
        tree_backend=config.tree_backend,
        saguaro=config.saguaro_x,
        block_size=config.block_size,
        num_blocks=engine.num_kv_blocks + config.max_num_seqs * blocks_per_seq,
        vocab_size=target.arch.vocab_size,
    )
    launch = DrafterLaunch(
        draft=draft_path,
        settings=settings,
        device=drafter_device,
        dtype=str(dtype).removeprefix("torch."),
        threads=len(drafter_cores) if drafter_cores else max(1, torch.get_num_threads()),
        cores=drafter_cores if drafter_device == "cpu" else None,
        max_positions=positions,
        seed=config.seed,
        load_options=config.load_options,
    )

    def in_process_fallback() -> DraftModelProposer:
        return DraftModelProposer(
            draft,
            vocab_size=target.arch.vocab_size,
            num_blocks=engine.num_kv_blocks,
            block_size=config.block_size,
            device=engine.device,
        )

    proposer = SSDProposer(
        launch,
        drafter=drafter,
        vocab_size=target.arch.vocab_size,
        timeout_s=config.drafter_timeout_s,
        fallback=in_process_fallback,
        pin_target=pin_target,
    )
    return SpeculativeStep(engine.runner, proposer, k=config.k, max_model_len=engine.max_model_len)


def _split_cores(config) -> tuple[tuple[int, ...] | None, tuple[int, ...] | None]:
    """Disjoint core sets for the target and the drafter: as configured, else the available
    cores split in halves (one machine with a single core shares it)."""
    import os

    from specfork.config import parse_cores

    available = tuple(sorted(os.sched_getaffinity(0)))
    target = parse_cores(config.target_cores, "target_cores") if config.target_cores else None
    drafter = parse_cores(config.draft_cores, "draft_cores") if config.draft_cores else None
    for name, cores in (("target_cores", target), ("draft_cores", drafter)):
        if cores is not None and not set(cores) <= set(available):
            raise SpecforkError(f"{name} {list(cores)} are not all available to this process (available: {list(available)})")
    if target is None and drafter is None:
        if len(available) < 2:
            return None, None
        half = len(available) // 2
        return available[:half], available[half:]
    if target is None:
        target = tuple(c for c in available if c not in drafter) or available
    if drafter is None:
        drafter = tuple(c for c in available if c not in target) or available
    return target, drafter

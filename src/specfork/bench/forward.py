"""One model forward in isolation, through the engine's model runner (paged KV cache, the same
kernels as decoding): what ``benchmarks/bench_draft_cost.py`` and ``bench_step_profile.py`` time."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from specfork.bench.timing import median, timed


@contextmanager
def unfused(model) -> Iterator[None]:
    """``model`` on the Python module path while inside: no one-call stack, no fused layers (what
    benchmarks time module by module, and what tests compare the native calls with)."""
    stack, layers = model.fused_stack, [layer.fused_decode for layer in model.layers]
    model.fused_stack = None
    for layer in model.layers:
        layer.fused_decode = None
    try:
        yield
    finally:
        model.fused_stack = stack
        for layer, fused in zip(model.layers, layers, strict=True):
            layer.fused_decode = fused


@contextmanager
def prefilled(llm, context: int, max_rows: int = 1, seed: int = 0) -> Iterator[Callable[[int], None]]:
    """A sequence of ``context`` random tokens prefilled into ``llm``'s KV cache. Yields
    ``forward(rows)``: the model on ``rows`` (<= ``max_rows``) more tokens at positions
    ``context..`` (a decode step for one row, a verification window for more), logits for every
    row; it can run again and again (it overwrites the same cache slots)."""
    from specfork.engine.sequence import Sequence
    from specfork.sampling_params import SamplingParams

    engine = llm.engine
    gen = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, engine.loaded.arch.vocab_size, (context + max_rows,), generator=gen).tolist()
    seq = Sequence(-1, prompt, SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(prompt))

    def forward(rows: int) -> None:
        engine.runner.forward([seq], [context], [prompt[context : context + rows]], list(range(rows)))

    try:
        engine.runner.forward([seq], [0], [prompt[:context]], [context - 1], decode=False)
        yield forward
    finally:
        engine.block_manager.free(seq)


def forward_ms(llm, context: int, rows: int = 1, repeat: int = 20, warmup: int = 3) -> float:
    """Median milliseconds of one forward of ``rows`` new tokens after ``context`` cached ones
    (``repeat`` timed forwards after ``warmup`` untimed)."""
    with prefilled(llm, context, rows) as forward:
        times = [timed(forward, rows)[1] for _ in range(warmup + repeat)]
    return median(times[warmup:]) * 1e3

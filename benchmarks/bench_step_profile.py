"""Where one decode step goes, for fp32 and native quantised weights (issue 9).

For each --weights setting: the model forward of 1..9 new tokens after --context cached ones
(decode and verification); its split into linear layers, attention and everything else (norms,
rotary, embedding, Python), measured by timing those modules inside real forwards on the Python
module path (the fused native decoder layer, when it runs, has no seams to time); one full engine
step (scheduling, sampling, stop checks included); bytes of weights read per token and the share
of the machine's streaming bandwidth; and the same for the shipped draft.

    python benchmarks/bench_step_profile.py --threads 2
"""

from __future__ import annotations

import argparse
import statistics
import time
from contextlib import contextmanager

import torch

from specfork import LLM, SamplingParams
from specfork.engine.sequence import Sequence
from specfork.layers import attention as attention_module
from specfork.layers.linear import DenseLinear
from specfork.layers.quantized import QuantizedLinear


class Clock:
    def __init__(self) -> None:
        self.seconds = {"linear": 0.0, "attention": 0.0}

    @contextmanager
    def installed(self, model):
        linears = [m for m in model.modules() if isinstance(m, (DenseLinear, QuantizedLinear))]
        originals = {m: m.forward for m in linears}
        paged = attention_module.paged_attention

        def timed(kind, fn):
            def run(*a, **kw):
                t = time.perf_counter()
                out = fn(*a, **kw)
                self.seconds[kind] += time.perf_counter() - t
                return out
            return run

        for m in linears:
            m.forward = timed("linear", originals[m])
        import specfork.models.llama as llama_module

        llama_module.paged_attention = timed("attention", paged)
        try:
            yield
        finally:
            for m in linears:
                m.forward = originals[m]
            llama_module.paged_attention = paged


def weight_bytes(model) -> int:
    total = 0
    for m in model.modules():
        if isinstance(m, QuantizedLinear):
            total += m.weight_bytes
        elif isinstance(m, DenseLinear):
            total += m.weight.numel() * m.weight.element_size()
    return total


def stream_read_gbps(threads: int) -> float:
    """This machine's streaming read bandwidth with ``threads`` threads (summing 400 MB, best of 5)."""
    torch.set_num_threads(threads)
    data = torch.ones(100_000_000)
    data.sum()
    best = min(_timed(data.sum) for _ in range(5))
    return data.numel() * data.element_size() / best / 1e9


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def profile(model_name: str, weights: str, threads: int, context: int, repeat: int, max_rows: int,
            bandwidth: float) -> None:
    llm = LLM(model_name, threads=threads, weights=weights, kv_cache_tokens=context + 4096)
    engine = llm.engine
    model = engine.loaded.model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.loaded.arch.vocab_size, (context + max_rows,), generator=gen).tolist()
    seq = Sequence(-1, prompt, SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(prompt))
    print(f"{model_name} --weights {weights}: {weight_bytes(model) / 1e6:.1f} MB of linear weights read per forward")
    fused = [layer.fused_decode for layer in model.layers]
    has_fused = any(f is not None for f in fused)
    print("  rows  forward ms" + ("  (module path: forward ms" if has_fused else "") + "  linear ms  attention ms  other ms"
          + (")" if has_fused else ""))

    def step(rows: int) -> None:
        engine.runner.forward([seq], [context], [prompt[context : context + rows]], list(range(rows)))

    try:
        engine.runner.forward([seq], [0], [prompt[:context]], [context - 1], decode=False)
        for rows in range(1, max_rows + 1):
            plain = statistics.median(_timed(lambda rows=rows: step(rows)) for _ in range(repeat + 3)) * 1e3
            # The split needs the Python module path: the fused layer (one native call per layer)
            # has no seams to time, so it is switched off for this part.
            for layer in model.layers:
                layer.fused_decode = None
            totals, parts = [], {"linear": [], "attention": []}
            for i in range(repeat + 3):
                clock = Clock()
                with clock.installed(model):
                    elapsed = _timed(lambda rows=rows: step(rows))
                if i >= 3:
                    totals.append(elapsed)
                    for k in parts:
                        parts[k].append(clock.seconds[k])
            for layer, f in zip(model.layers, fused, strict=True):
                layer.fused_decode = f
            f, lin, att = (statistics.median(x) * 1e3 for x in (totals, parts["linear"], parts["attention"]))
            split = f"{lin:9.2f}  {att:12.2f}  {f - lin - att:8.2f}"
            print(f"  {rows:4d}  {plain:10.2f}  " + (f"{f:24.2f}  " if has_fused else "") + split)
    finally:
        engine.block_manager.free(seq)
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    llm.generate([prompt[:context]], params)
    steps = []
    seq = engine.add_request(prompt[:context], params)
    while not seq.is_finished:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    decode = statistics.median(steps[1:]) * 1e3
    print(f"  one engine decode step (forward + sampling + scheduling): {decode:.2f} ms = {1000 / decode:.1f} tok/s")
    rate = weight_bytes(model) / (decode / 1e3) / 1e9
    print(f"  weights streamed at that rate: {rate:.1f} GB/s = {100 * rate / bandwidth:.0f}% of the "
          f"{bandwidth:.1f} GB/s this machine reads with {threads} threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="default", help="also profile this draft (default: the shipped one; '' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--max-rows", type=int, default=9)
    args = parser.parse_args()
    bandwidth = stream_read_gbps(args.threads)
    torch.set_num_threads(args.threads)
    for weights in ("fp32", "native"):
        profile(args.model, weights, args.threads, args.context, args.repeat, args.max_rows, bandwidth)
    if args.draft:
        from specfork.loading.resolve import resolve_checkpoint, resolve_draft

        draft = str(resolve_draft(args.draft, resolve_checkpoint(args.model)))
        for weights in ("fp32", "native"):
            profile(draft, weights, args.threads, args.context, args.repeat, 1, bandwidth)


if __name__ == "__main__":
    main()

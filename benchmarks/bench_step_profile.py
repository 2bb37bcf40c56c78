"""Where one decode step goes, for fp32 and native quantised weights (issue 9).

For each --weights setting: the model forward of 1..9 new tokens after --context cached ones
(decode and verification), split into linear layers, attention and everything else (norms,
rotary, embedding, Python), measured by timing those modules inside real forwards; one full
engine step (scheduling, sampling, stop checks included); bytes of weights read per token; and
the same for the shipped draft.

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


def profile(model_name: str, weights: str, threads: int, context: int, repeat: int, max_rows: int) -> None:
    llm = LLM(model_name, threads=threads, weights=weights, kv_cache_tokens=context + 4096)
    engine = llm.engine
    model = engine.loaded.model
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, engine.loaded.arch.vocab_size, (context + max_rows,), generator=gen).tolist()
    seq = Sequence(-1, prompt, SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(prompt))
    print(f"{model_name} --weights {weights}: {weight_bytes(model) / 1e6:.1f} MB of linear weights read per forward")
    print("  rows  forward ms  linear ms  attention ms  other ms")
    try:
        engine.runner.forward([seq], [0], [prompt[:context]], [context - 1], decode=False)
        for rows in range(1, max_rows + 1):
            totals, parts = [], {"linear": [], "attention": []}
            for i in range(repeat + 3):
                clock = Clock()
                with clock.installed(model):
                    start = time.perf_counter()
                    engine.runner.forward([seq], [context], [prompt[context : context + rows]], list(range(rows)))
                    elapsed = time.perf_counter() - start
                if i >= 3:
                    totals.append(elapsed)
                    for k in parts:
                        parts[k].append(clock.seconds[k])
            f, lin, att = (statistics.median(x) * 1e3 for x in (totals, parts["linear"], parts["attention"]))
            print(f"  {rows:4d}  {f:10.2f}  {lin:9.2f}  {att:12.2f}  {f - lin - att:8.2f}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="default", help="also profile this draft (default: the shipped one; '' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--max-rows", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    for weights in ("fp32", "native"):
        profile(args.model, weights, args.threads, args.context, args.repeat, args.max_rows)
    if args.draft:
        from specfork.loading.resolve import resolve_checkpoint, resolve_draft

        draft = str(resolve_draft(args.draft, resolve_checkpoint(args.model)))
        for weights in ("fp32", "native"):
            profile(draft, weights, args.threads, args.context, args.repeat, 1)


if __name__ == "__main__":
    main()

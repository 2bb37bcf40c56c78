"""Where one decode step goes, for fp32 and native quantised weights (issue 9).

For each --weights setting: the model forward of 1..9 new tokens after --context cached ones
(decode and verification); its split into linear layers, attention and everything else (norms,
rotary, embedding, Python), measured by timing those modules inside real forwards on the Python
module path (the fused native decoder layer, when it runs, has no seams to time); one full engine
step (scheduling, sampling, stop checks included) and how much of it is spent outside the one
native call (Python's share), and per token, greedy, sampled and sampled with a repetition
penalty, at one and at --decode-steps decode steps a native call; bytes of weights read per token and the share of the machine's
streaming bandwidth; and the same for the shipped draft.

    python benchmarks/bench_step_profile.py --threads 2
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager

import torch

from specfork import LLM, SamplingParams
from specfork.bench.forward import forward_ms, prefilled, unfused
from specfork.bench.machine import read_bandwidth, weight_bytes
from specfork.bench.timing import median, timed
from specfork.datasets import encode, load_prompts
from specfork.layers import attention as attention_module
from specfork.layers.linear import DenseLinear
from specfork.layers.quantized import QuantizedLinear


class ModuleClock:
    """Seconds spent in linear layers and in paged attention while installed in a model."""


    def __init__(self) -> None:
        self.seconds = {"linear": 0.0, "attention": 0.0}

    @contextmanager
    def installed(self, model):
        linears = [m for m in model.modules() if isinstance(m, (DenseLinear, QuantizedLinear))]
        originals = {m: m.forward for m in linears}
        paged = attention_module.paged_attention

        def wrapped(kind, fn):
            def run(*a, **kw):
                out, seconds = timed(fn, *a, **kw)
                self.seconds[kind] += seconds
                return out
            return run

        for m in linears:
            m.forward = wrapped("linear", originals[m])
        import specfork.models.llama as llama_module

        llama_module.paged_attention = wrapped("attention", paged)
        try:
            yield
        finally:
            for m in linears:
                m.forward = originals[m]
            llama_module.paged_attention = paged


def module_split_ms(model, forward, rows: int, repeat: int, warmup: int = 3) -> tuple[float, float, float]:
    """Median (forward, linear, attention) ms of ``forward(rows)`` on the Python module path: the
    native calls (the whole stack, or one per layer) have no seams to time, so they are off here."""
    totals, parts = [], {"linear": [], "attention": []}
    with unfused(model):
        for i in range(warmup + repeat):
            modules = ModuleClock()
            with modules.installed(model):
                _, elapsed = timed(forward, rows)
            if i >= warmup:
                totals.append(elapsed)
                for k in parts:
                    parts[k].append(modules.seconds[k])
    return tuple(median(x) * 1e3 for x in (totals, parts["linear"], parts["attention"]))


def engine_step_ms(llm, prompt: list[int], max_tokens: int = 64) -> tuple[float, float | None, float | None]:
    """Median ms of one full engine decode step (forward, sampling, scheduling, stop checks); the
    median ms of those steps spent inside the one native call; and the median ms of a step whose
    native call is replaced by its last result, returned at once (the two None without the call).

    The last is Python's own work with its code and data still in the caches: a real native call
    streams every weight of the model (more than the caches hold) through them, so the Python
    after it first reads back from memory what it needs."""
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    llm.generate([prompt], params)  # warm-up
    model = llm.engine.loaded.model
    stack, native, last = model.fused_stack, [], []

    def timed_stack(*args):
        out, seconds = timed(stack, *args)
        native[-1] += seconds
        last[:] = [out]
        return out

    def replayed_stack(x, *args):
        return last[0] if x.shape[0] == 1 else stack(x, *args)  # a decode row; a prefill runs

    def decode_steps(stack_in_use) -> list[float]:
        seq = llm.engine.add_request(prompt, params)
        steps = []
        if stack is not None:
            model.fused_stack = stack_in_use
        try:
            while not seq.is_finished:
                native.append(0.0)
                steps.append(timed(llm.engine.step)[1])
        finally:
            model.fused_stack = stack
        return steps[1:]  # the first step is the prefill

    steps = decode_steps(timed_stack)
    if stack is None:
        return median(steps) * 1e3, None, None
    native_ms = median(native[1:]) * 1e3
    native.clear()
    warm = decode_steps(replayed_stack)
    return median(steps) * 1e3, native_ms, median(warm) * 1e3


class NativeClock:
    """Stands in for a fused stack's native object: its calls run, their seconds are summed."""

    def __init__(self, native) -> None:
        self.native, self.seconds = native, 0.0

    def forward(self, *args):
        return self._timed(self.native.forward, *args)

    def decode_steps(self, *args):
        return self._timed(self.native.decode_steps, *args)

    def _timed(self, fn, *args):
        out, seconds = timed(fn, *args)
        self.seconds += seconds
        return out


def run_ms(llm, prompt: list[int], params: SamplingParams, steps: int) -> tuple[float, float]:
    """Per token, the mean ms of decoding ``prompt`` with ``params`` (max_tokens of them, EOS
    ignored) at up to ``steps`` decode steps a native call (at most the engine's
    ``--decode-steps``), and the mean ms of it inside the native calls."""
    strategy, stack = llm.engine.step_strategy, llm.engine.loaded.model.fused_stack
    configured, native = strategy.decode_steps, stack._stack
    clock = NativeClock(native)
    strategy.decode_steps, stack._stack = steps, clock  # fewer steps than configured: the same reservations
    try:
        seq = llm.engine.add_request(prompt, params)
        llm.engine.step()  # the prefill
        clock.seconds = 0.0

        def decode_to_the_end() -> None:
            while not seq.is_finished:
                llm.engine.step()

        _, total = timed(decode_to_the_end)
    finally:
        strategy.decode_steps, stack._stack = configured, native
    tokens = len(seq.output_token_ids) - 1
    return total / tokens * 1e3, clock.seconds / tokens * 1e3


def profile(model_name: str, weights: str, threads: int, context: int, repeat: int, max_rows: int,
            bandwidth: float) -> None:
    llm = LLM(model_name, threads=threads, weights=weights, kv_cache_tokens=context + 4096)
    model = llm.engine.loaded.model
    linear_bytes = weight_bytes(model)["linear"]
    print(f"{model_name} --weights {weights}: {linear_bytes / 1e6:.1f} MB of linear weights read per forward")
    has_fused = any(layer.fused_decode is not None for layer in model.layers)
    print("  rows  forward ms" + ("  (module path: forward ms" if has_fused else "") + "  linear ms  attention ms  other ms"
          + (")" if has_fused else ""))
    for rows in range(1, max_rows + 1):
        plain = forward_ms(llm, context, rows, repeat)
        with prefilled(llm, context, rows) as forward:
            f, lin, att = module_split_ms(model, forward, rows, repeat)
        split = f"{lin:9.2f}  {att:12.2f}  {f - lin - att:8.2f}"
        print(f"  {rows:4d}  {plain:10.2f}  " + (f"{f:24.2f}  " if has_fused else "") + split)
    gen = torch.Generator().manual_seed(0)
    prompt = torch.randint(0, llm.vocab_size, (context,), generator=gen).tolist()
    decode, native, warm = engine_step_ms(llm, prompt)
    print(f"  one engine decode step (forward + sampling + scheduling): {decode:.2f} ms = {1000 / decode:.1f} tok/s")
    if native is not None:
        print(f"  of which inside the one native call (all layers and the LM head): {native:.2f} ms; outside it "
              f"(Python: scheduling, embedding lookup, rope tables, sampling, outputs): {decode - native:.2f} ms "
              f"= {100 * (decode - native) / decode:.1f}% of the step")
        print(f"  the same Python with the native call replaced by its last result (its code and data left in the "
              f"caches, where a real call streams the weights through them): {warm:.2f} ms = {100 * warm / decode:.1f}% "
              f"of the step")
    configured = getattr(llm.engine.step_strategy, "decode_steps", 1)
    if native is not None and configured > 1:
        # A real chat prompt: after the random tokens above, the next token's distribution is nearly
        # flat, and top-p's nucleus of thousands of tokens makes the draw itself cost ~3 ms.
        prompt = encode(llm, load_prompts("sharegpt", "eval", 1)[0])
        for label, params in (("greedy", SamplingParams(temperature=0.0, max_tokens=129, ignore_eos=True)),
                              ("sampled (temperature 1, top-p 0.95)",
                               SamplingParams(temperature=1.0, top_p=0.95, max_tokens=129, ignore_eos=True, seed=0)),
                              ("sampled with repetition penalty 1.1",
                               SamplingParams(temperature=1.0, top_p=0.95, max_tokens=129, ignore_eos=True, seed=0,
                                              repetition_penalty=1.1))):
            for steps in (1, configured):
                per_token, inside = run_ms(llm, prompt, params, steps)
                print(f"  {label}, {steps} decode step{'s' if steps > 1 else ''} a native call "
                      f"(--decode-steps {steps}): {per_token:.2f} ms a token = {1000 / per_token:.1f} tok/s, "
                      f"{per_token - inside:.2f} ms of it outside the calls = "
                      f"{100 * (per_token - inside) / per_token:.1f}%")
    rate = linear_bytes / (decode / 1e3) / 1e9
    print(f"  weights streamed at that rate: {rate:.1f} GB/s = {100 * rate / bandwidth:.0f}% of the "
          f"{bandwidth:.1f} GB/s this machine reads with {threads} threads")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--draft", default="default",
                        help="also profile this draft model (default: the shipped one; '' to skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--context", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument("--max-rows", type=int, default=9)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    bandwidth = read_bandwidth(nbytes=400_000_000)["read_GBps"]  # summing 400 MB, best of 5
    for weights in ("fp32", "native"):
        profile(args.model, weights, args.threads, args.context, args.repeat, args.max_rows, bandwidth)
    if args.draft:
        from specfork.loading.resolve import resolve_checkpoint, resolve_draft

        draft = str(resolve_draft(args.draft, resolve_checkpoint(args.model), heads=False))
        for weights in ("fp32", "native"):
            profile(draft, weights, args.threads, args.context, args.repeat, 1, bandwidth)


if __name__ == "__main__":
    main()

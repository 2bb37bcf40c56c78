"""Decode and verify steps on a GPU with and without CUDA graphs (engine/step_graphs.py).

Two engines on the same model, one replaying captured graphs (the default) and one eager
(--no-cuda-graphs), timed interleaved in one process:
- one forward of 1..--max-rows new tokens after --context cached ones (a decode step, then
  verification windows), median of --repeat;
- greedy generation of --output-len tokens for each batch size of --batch-sizes (random prompts
  of --prompt-len tokens), tokens per second, best of --repeat-generate.

    python benchmarks/bench_cuda_graphs.py                       # the embedded model
    python benchmarks/bench_cuda_graphs.py --model DIR_OR_GGUF --batch-sizes 1,8,32
"""

from __future__ import annotations

import argparse
from contextlib import ExitStack

import torch

from specfork import LLM, SamplingParams
from specfork.bench.forward import prefilled
from specfork.bench.timing import median, timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="alias, HF directory or GGUF (default: the embedded model)")
    parser.add_argument("--device", default="cuda", help="cuda[:N] (on cpu both engines run eagerly: a smoke test)")
    parser.add_argument("--dtype", default=None, help="the engines' --dtype (default: float32)")
    parser.add_argument("--context", type=int, default=256, help="cached tokens before the timed forwards")
    parser.add_argument("--max-rows", type=int, default=8, help="forwards of 1..N rows are timed")
    parser.add_argument("--repeat", type=int, default=20, help="timed forwards per row count (median)")
    parser.add_argument("--batch-sizes", default="1,8,32", help="comma list of concurrent requests")
    parser.add_argument("--prompt-len", type=int, default=64, help="random prompt tokens per request")
    parser.add_argument("--output-len", type=int, default=128, help="generated tokens per request")
    parser.add_argument("--repeat-generate", type=int, default=2, help="timed generations per batch size (best)")
    args = parser.parse_args()
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("CUDA is not available here (CUDA graphs exist on GPUs only)")
    batches = [int(b) for b in args.batch_sizes.split(",")]
    rows = list(range(1, args.max_rows + 1))
    kinds = {"eager": False, "graphs": True}
    step_ms: dict[tuple[str, int], list[float]] = {(kind, m): [] for kind in kinds for m in rows}
    with ExitStack() as engines:
        # k sizes the verify windows an engine graphs (k + 1 rows), also in AR mode
        llms = {kind: engines.enter_context(LLM(args.model, device=args.device, dtype=args.dtype, cuda_graphs=on,
                                                k=args.max_rows - 1, max_num_seqs=max(batches)))
                for kind, on in kinds.items()}
        with ExitStack() as prefills:  # the prefilled sequences give their blocks back after the steps
            forwards = {kind: prefills.enter_context(prefilled(llm, args.context, args.max_rows))
                        for kind, llm in llms.items()}
            for i in range(args.repeat + 2):  # the first two rounds warm up (and capture)
                for m in rows:
                    for kind, forward in forwards.items():
                        _sync()
                        seconds = timed(_synced, forward, m)[1]
                        if i >= 2:
                            step_ms[(kind, m)].append(seconds * 1e3)
        rates = _generation(llms, args, batches)
    ms = {key: median(v) for key, v in step_ms.items()}
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(f"{args.model} on {name}, torch {torch.__version__}, context {args.context}; median of {args.repeat}")
    print("rows  eager ms  graphs ms  speedup  eager vs 1 row  graphs vs 1 row")
    for m in rows:
        e, g = ms[("eager", m)], ms[("graphs", m)]
        print(f"{m:4d}  {e:8.2f}  {g:9.2f}  {e / g:6.2f}x  {e / ms[('eager', 1)]:13.2f}x  "
              f"{g / ms[('graphs', 1)]:14.2f}x")
    print(f"greedy generation, {args.output_len} tokens per request, best of {args.repeat_generate}")
    print("batch  eager tok/s  graphs tok/s  speedup  graphs vs batch 1")
    for b in batches:
        e, g = rates[("eager", b)], rates[("graphs", b)]
        print(f"{b:5d}  {e:11.1f}  {g:12.1f}  {g / e:6.2f}x  {g / rates[('graphs', batches[0])]:16.2f}x")


def _generation(llms: dict, args, batches: list[int]) -> dict[tuple[str, int], float]:
    """Tokens per second of greedy AR generation per engine kind and batch size."""
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    vocab = next(iter(llms.values())).engine.loaded.arch.vocab_size
    rates: dict[tuple[str, int], float] = {}
    for b in batches:
        prompts = torch.randint(0, vocab, (b, args.prompt_len), generator=gen).tolist()
        for kind, llm in llms.items():
            llm.generate(prompts[:1], warm, use_tqdm=False)
            best = min(timed(llm.generate, prompts, params, use_tqdm=False)[1] for _ in range(args.repeat_generate))
            rates[(kind, b)] = b * args.output_len / best
    return rates


def _synced(forward, rows: int) -> None:
    """One forward, finished on the device."""
    forward(rows)
    _sync()


def _sync() -> None:
    """Wait for the GPU's queued work (the forwards return before it is done)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


if __name__ == "__main__":
    main()

"""Two builds of the native kernels in one process: a git revision's sources (built under another
module name: Python hands back the first module of a name, whatever its path) against the work
tree's. The target's forward after 256 cached tokens at 1..ROWS rows, then AR at batch 1 end to
end (8 + 8 eval prompts, 256 greedy tokens), the builds alternating with the order swapped each
time (docs/decisions.md, "Scales and offsets stay fp16"):

    python docs/experiments/kernel_builds_ab.py REVISION ROWS REPEATS
    python docs/experiments/kernel_builds_ab.py 26b1d1d 6 101
"""

import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

from torch.utils.cpp_extension import load

import specfork.native_kernels as native
from specfork import LLM, SamplingParams
from specfork.bench.forward import prefilled
from specfork.bench.timing import timed
from specfork.datasets import encode, load_prompts


def build(revision: str, work: Path):
    csrc = work / "csrc"
    csrc.mkdir()
    listed = subprocess.run(["git", "ls-tree", "--name-only", f"{revision}:src/specfork/csrc"], capture_output=True,
                            text=True, check=True)
    for name in listed.stdout.split():
        text = subprocess.run(["git", "show", f"{revision}:src/specfork/csrc/{name}"], capture_output=True, text=True,
                              check=True)
        (csrc / name).write_text(text.stdout)
    return load(name="kernels_" + revision.replace("-", "_"), sources=[str(csrc / s) for s in native.SOURCES],
                build_directory=str(work), extra_cflags=list(native.FLAGS), extra_ldflags=["-fopenmp"])


def engine_on(kernels, **options) -> LLM:
    """An engine whose layers were built with ``kernels`` (every module's reference swapped meanwhile)."""
    current, swapped = native.kernels, []
    for module in list(sys.modules.values()):
        for attr, value in list(getattr(module, "__dict__", {}).items()):
            if value is current:
                swapped.append((module, attr))
                setattr(module, attr, lambda: kernels)
    try:
        return LLM(threads=2, **options)
    finally:
        for module, attr in swapped:
            setattr(module, attr, current)


def main(revision: str, rows: int, repeats: int) -> None:
    with tempfile.TemporaryDirectory() as work, ExitStack() as stack:
        old = build(revision, Path(work))
        engines = {revision: engine_on(old, kv_cache_tokens=4352), "work tree": LLM(threads=2, kv_cache_tokens=4352)}
        forwards = {name: stack.enter_context(prefilled(llm, 256, rows)) for name, llm in engines.items()}
        names, times = list(engines), {}
        for i in range(repeats + 2):  # two rounds warm up
            for m in range(1, rows + 1):
                for name in names if i % 2 else names[::-1]:
                    seconds = timed(forwards[name], m)[1]
                    if i >= 2:
                        times.setdefault((name, m), []).append(seconds)
        for m in range(1, rows + 1):
            a, b = (statistics.median(times[n, m]) * 1e3 for n in names)
            print(f"forward, {m} rows: {names[0]} {a:.2f} ms, work tree {b:.2f} ms ({b / a:.3f}x the time)")
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    for dataset in ("humaneval", "sharegpt"):
        prompts = [encode(engines[names[0]], p) for p in load_prompts(dataset, "eval", 8)]
        seconds, tokens, outputs = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0), {n: [] for n in names}
        for i, prompt in enumerate(prompts):
            for name in names if i % 2 else names[::-1]:
                start = time.perf_counter()
                out = engines[name].generate([prompt], params)
                seconds[name] += time.perf_counter() - start
                tokens[name] += len(out[0].token_ids)
                outputs[name].append(out[0].token_ids)
        rates = [tokens[n] / seconds[n] for n in names]
        same = sum(a == b for a, b in zip(*outputs.values(), strict=True))
        print(f"AR {dataset}: {names[0]} {rates[0]:.1f} tok/s, work tree {rates[1]:.1f} tok/s "
              f"({rates[1] / rates[0]:.3f}x), same output {same}/{len(prompts)}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))

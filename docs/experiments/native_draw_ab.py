"""The native draws against the PyTorch ones, in one process: the same engine generates each batch
twice, once with the compiled kernels hidden from `specfork.sampling` (its PyTorch path, as before
the kernels) and once with them, the order alternating (docs/benchmarks.md, "Sampled tokens: one
native pass per row"):

    python docs/experiments/native_draw_ab.py TEMPERATURE BATCH PROMPTS REPEATS [sd]
    python docs/experiments/native_draw_ab.py 1.0 8 8 4

The table in docs/benchmarks.md was measured when only AR's draw (`sample_tokens`) had a kernel,
by swapping that function; this script hides both kernels (`sample_tokens` and `sample_from_probs`).
"""

import sys
import time

import specfork.sampling as sampling
from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts


def main(temperature: float, batch: int, num_prompts: int, repeats: int, mode: str = "ar") -> None:
    with_kernels = sampling._cpu_kernels
    arms = {"pytorch": lambda logits: None, "native": with_kernels}
    llm = LLM(threads=2, max_num_seqs=batch, **({} if mode == "ar" else {"mode": mode}))
    params = SamplingParams(temperature=temperature, max_tokens=256, ignore_eos=True, seed=0)
    for dataset in ("humaneval", "sharegpt"):
        ids = [encode(llm, p) for p in load_prompts(dataset, "eval", num_prompts)]
        groups = [ids[i : i + batch] for i in range(0, len(ids), batch)]
        llm.generate(groups[0][:1], SamplingParams(temperature=temperature, max_tokens=16, seed=0))  # warm-up
        seconds = dict.fromkeys(arms, 0.0)
        tokens = dict.fromkeys(arms, 0)
        for r in range(repeats):
            for name in arms if r % 2 == 0 else list(arms)[::-1]:
                sampling._cpu_kernels = arms[name]
                for group in groups:
                    t = time.perf_counter()
                    outs = llm.generate(group, params)
                    seconds[name] += time.perf_counter() - t
                    tokens[name] += sum(len(o.token_ids) for o in outs)
        sampling._cpu_kernels = with_kernels
        base = tokens["pytorch"] / seconds["pytorch"]
        rates = ", ".join(f"{n} {tokens[n] / seconds[n]:.1f} ({tokens[n] / seconds[n] / base:.3f}x)" for n in arms)
        sys.stdout.write(f"{mode} {dataset} T={temperature} batch {batch} x{repeats}: {rates}\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(float(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), *sys.argv[5:])

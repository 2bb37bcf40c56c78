"""AR and SD (k 5) tok/s greedy and sampled (temperature 0.8, top-p 0.95, top-k 40), 128 tokens
from ShareGPT eval prompts, seed 3; one line per mode. Run once at a commit and once at another
(docs/benchmarks.md, "sampling without sorting"):

    python docs/experiments/sampling_speed.py BATCH PROMPTS ar,sd
"""
import sys, time
from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
B = int(sys.argv[1]); n = int(sys.argv[2]); modes = sys.argv[3].split(",")
settings = {"greedy": dict(temperature=0.0), "T0.8": dict(temperature=0.8), "T0.8,p0.95": dict(temperature=0.8, top_p=0.95),
            "T0.8,k40,p0.95": dict(temperature=0.8, top_k=40, top_p=0.95)}
for mode in modes:
    llm = LLM(threads=2, max_num_seqs=B) if mode == "ar" else LLM(threads=2, max_num_seqs=B, mode="sd", k=5)
    prompts = [encode(llm, p) for p in load_prompts("sharegpt", "eval", n)]
    llm.generate(prompts[:B], SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True))
    out = []
    for name, kw in settings.items():
        t = time.perf_counter(); o = llm.generate(prompts, SamplingParams(max_tokens=128, ignore_eos=True, seed=3, **kw)); el = time.perf_counter() - t
        out.append(f"{name} {sum(len(x.token_ids) for x in o) / el:.1f}")
    print(f"{mode} batch {B}: " + ", ".join(out), flush=True)

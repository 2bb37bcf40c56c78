"""AR and SD (their defaults) sampled with top-k / top-p, 128 tokens from ShareGPT eval prompts,
seed 3: the native filter against the PyTorch filter (the path top-k and top-p rows took before:
logits_to_probs, then the native weight draw), the two alternating batch by batch in one process
(docs/benchmarks.md, "top-k and top-p filtered natively"):

    python docs/experiments/native_filter_ab.py BATCH PROMPTS ar,sd REPEATS
    python docs/experiments/native_filter_ab.py 1 4 ar,sd 2
"""
import sys, time, torch
from specfork import LLM, SamplingParams
from specfork import sampling
from specfork.engine import step as engine_step
from specfork.speculative import sd_step
from specfork.datasets import encode, load_prompts

def pytorch_filtered(logits, params):
    return sampling.logits_to_probs(logits, *sampling.sampling_tensors(params, logits.device))

native = dict(filtered=sampling.filtered_probs, tokens=engine_step.sample_tokens, sd_filtered=sd_step.filtered_probs,
              sd_native=sd_step.native_sampler)
old = dict(filtered=pytorch_filtered, tokens=lambda l, p, g: sampling.sample(l, p, g).tokens, sd_filtered=pytorch_filtered,
           sd_native=lambda logits: None)

def use(v):
    sampling.filtered_probs = v["filtered"]; engine_step.sample_tokens = v["tokens"]
    sd_step.filtered_probs = v["sd_filtered"]; sd_step.native_sampler = v["sd_native"]

B = int(sys.argv[1]); n = int(sys.argv[2]); modes = sys.argv[3].split(","); reps = int(sys.argv[4])
settings = {"T0.8,p0.95": dict(temperature=0.8, top_p=0.95), "T0.8,k40,p0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
            "T1.0,k50": dict(temperature=1.0, top_k=50)}
for mode in modes:
    llm = LLM(threads=2, max_num_seqs=B) if mode == "ar" else LLM(threads=2, max_num_seqs=B, mode="sd")
    prompts = [encode(llm, p) for p in load_prompts("sharegpt", "eval", n)]
    llm.generate(prompts[:B], SamplingParams(temperature=0.8, top_p=0.9, max_tokens=16, ignore_eos=True))
    for name, kw in settings.items():
        secs = {"old": 0.0, "new": 0.0}; toks = {"old": 0, "new": 0}
        for r in range(reps):
            for i in range(0, n, B):
                group = prompts[i:i + B]
                for v in (("old", "new") if (r + i) % 2 == 0 else ("new", "old")):
                    use(old if v == "old" else native)
                    t = time.perf_counter()
                    o = llm.generate(group, SamplingParams(max_tokens=128, ignore_eos=True, seed=3, **kw))
                    secs[v] += time.perf_counter() - t; toks[v] += sum(len(x.token_ids) for x in o)
        a, b = toks["old"] / secs["old"], toks["new"] / secs["new"]
        print(f"{mode} batch {B} {name}: pytorch filter {a:.1f} tok/s, native filter {b:.1f} tok/s ({b / a:.3f}x)", flush=True)
    use(native)

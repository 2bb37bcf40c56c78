"""One process: AR, SD with the old k auto policy (548d186, priced per sequence) and SD with the
new one (priced per batch), on the same prompts, interleaved per group of B prompts (rotating
order), outputs checked equal to AR's. The old policy is that commit's module, wrapped in the new
interface:

    git show 548d186:src/specfork/speculative/auto_k.py > /tmp/s15/old_auto_k.py
    python docs/experiments/kauto_batch_ab.py BATCH PROMPTS [head|draft|ngram]
"""
import sys, time, collections, importlib.util
from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
spec = importlib.util.spec_from_file_location("old_auto_k", "/tmp/s15/old_auto_k.py")
old = importlib.util.module_from_spec(spec); sys.modules["old_auto_k"] = old; spec.loader.exec_module(old)

class OldPolicy:
    def __init__(self, new):
        self.inner = old.AutoK(old.StepCosts(new.costs.draft_s, new.costs.verify_s))
        self.costs = self.inner.costs
    def ks_for_round(self, batch=1):
        return [self.inner.k_for_round()] * batch
    def end_round(self, ks, seconds):
        self.inner.end_round(max(ks), seconds)
    def observe(self, p, a):
        self.inner.observe(p, a)
    def explain(self):
        return self.inner.explain()

B = int(sys.argv[1]); n = int(sys.argv[2]); drafter = sys.argv[3] if len(sys.argv) > 3 else "head"
extra = {"draft": dict(draft="smollm2-135m-draft"), "ngram": dict(drafter="ngram"), "head": {}}[drafter]
params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
llms = {"ar": LLM(threads=2, max_num_seqs=B), "sd-old": LLM(threads=2, max_num_seqs=B, mode="sd", k="auto", **extra),
        "sd-new": LLM(threads=2, max_num_seqs=B, mode="sd", k="auto", **extra)}
st = llms["sd-old"].engine.step_strategy
st.auto_k = OldPolicy(st.auto_k)
names = list(llms)
for ds in ("humaneval", "sharegpt"):
    prompts = [encode(llms["ar"], p) for p in load_prompts(ds, "eval", n)]
    for llm in llms.values():
        llm.generate(prompts[:B], SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True))
    times, toks, outs = collections.defaultdict(float), collections.defaultdict(int), collections.defaultdict(list)
    for g, i in enumerate(range(0, n, B)):
        group = prompts[i:i + B]
        order = names[g % 3:] + names[:g % 3]
        for name in order:
            t = time.perf_counter(); o = llms[name].generate(group, params); times[name] += time.perf_counter() - t
            toks[name] += sum(len(x.token_ids) for x in o); outs[name] += [x.token_ids for x in o]
    assert outs["sd-old"] == outs["ar"] and outs["sd-new"] == outs["ar"]
    rate = {k: toks[k] / times[k] for k in names}
    print(f"{ds} batch {B} {drafter}: " + ", ".join(f"{k} {rate[k]:.1f} tok/s ({rate[k] / rate['ar']:.3f}x AR)" for k in names))

"""At the first draft position of SD rounds (temperature T, the shipped head, k 1, no lookup or
floor): how often would the head's token be accepted if it were drawn from q^(1/tau) (normalised)
instead of q? Acceptance of a draft drawn from q' is sum_v min(p(v), q'(v)), exactly.
(docs/benchmarks.md, "Tried, no gain: drawing the head's drafts from a sharpened q"):

    python docs/experiments/sharpened_draft_acceptance.py 1.0 1.0     # temperature, top-p
    python docs/experiments/sharpened_draft_acceptance.py 0.8 0.95
"""
import sys, torch
import specfork.speculative.sd_step as sd_step
from specfork import LLM, SamplingParams
from specfork.datasets import load_prompts, encode
T = float(sys.argv[1]); top_p = float(sys.argv[2])
TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3)
rows = []
orig = sd_step.verify_sampled
def rec(target_probs, proposed, q, gen):
    if q is not None and len(proposed) >= 1:
        p, q0 = target_probs[0].double(), q[0].double()
        logq = torch.where(q0 > 0, q0.log(), torch.full_like(q0, float("-inf")))
        acc = [float(torch.minimum(p, torch.softmax(logq / tau, -1)).sum()) for tau in TAUS]
        acc.append(float(p[int(q0.argmax())]))  # one-hot on q's mode
        acc.append(float(p.max()))  # the best any one-hot could do (the target's mode)
        rows.append(acc)
    return orig(target_probs, proposed, q, gen)
sd_step.verify_sampled = rec
llm = LLM(mode="sd", k=1, draft_confidence=0.0, lookup_first=0, threads=2)
for ds in ("humaneval", "sharegpt"):
    rows.clear()
    ids = [encode(llm, p) for p in load_prompts(ds, "eval", 6)]
    llm.generate(ids, SamplingParams(temperature=T, top_p=top_p, max_tokens=128, ignore_eos=True, seed=1))
    m = torch.tensor(rows).mean(0).tolist()
    print(ds, len(rows), "rounds; acceptance by tau", {t: round(a, 3) for t, a in zip(TAUS, m)},
          "one-hot q mode", round(m[-2], 3), "target mode", round(m[-1], 3), flush=True)

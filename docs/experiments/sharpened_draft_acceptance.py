"""At the first draft position of SD rounds (temperature T, the shipped head, k 1, no lookup or
floor): how often would the head's token be accepted if it were drawn from q^(1/tau) (normalised)
instead of q? Acceptance of a draft drawn from q' is sum_v min(p(v), q'(v)), exactly.
(docs/benchmarks.md, "Tried, no gain: drawing the head's drafts from a sharpened q"):

    python docs/experiments/sharpened_draft_acceptance.py 1.0 1.0     # temperature, top-p
    python docs/experiments/sharpened_draft_acceptance.py 0.8 0.95
"""

import sys

import torch

import specfork.speculative.sd_step as sd_step
from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts

TAUS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.3)


def main(temperature: float, top_p: float) -> None:
    rows = []
    verify = sd_step.verify_sampled

    def recording(target_probs, proposed, q, generator):
        if q is not None and len(proposed) >= 1:
            p, q0 = target_probs[0].double(), q[0].double()
            logq = torch.where(q0 > 0, q0.log(), torch.full_like(q0, float("-inf")))
            acc = [float(torch.minimum(p, torch.softmax(logq / tau, -1)).sum()) for tau in TAUS]
            acc.append(float(p[int(q0.argmax())]))  # a one-hot draft of q's mode
            acc.append(float(p.max()))  # the best any one-hot draft could do (the target's mode)
            rows.append(acc)
        return verify(target_probs, proposed, q, generator)

    sd_step.verify_sampled = recording
    llm = LLM(mode="sd", k=1, draft_confidence=0.0, lookup_first=0, threads=2)
    for dataset in ("humaneval", "sharegpt"):
        rows.clear()
        ids = [encode(llm, p) for p in load_prompts(dataset, "eval", 6)]
        llm.generate(ids, SamplingParams(temperature=temperature, top_p=top_p, max_tokens=128, ignore_eos=True, seed=1))
        mean = torch.tensor(rows).mean(0).tolist()
        by_tau = {tau: round(a, 3) for tau, a in zip(TAUS, mean, strict=False)}
        sys.stdout.write(f"{dataset} {len(rows)} rounds; acceptance by tau {by_tau}, one-hot q mode {mean[-2]:.3f}, "
                         f"target mode {mean[-1]:.3f}\n")


if __name__ == "__main__":
    main(float(sys.argv[1]), float(sys.argv[2]))

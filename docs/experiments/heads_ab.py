"""Two EAGLE-3 heads in one process: the head alone (k 5, no lookup, no floor) and SD at its defaults,
against AR, prompt by prompt with the engines alternating; greedy outputs checked against AR's
(src/specfork/drafts/README.md, stage 9):

    python docs/experiments/heads_ab.py OLD_HEAD_DIR NEW_HEAD_DIR PROMPTS REPEATS
    python docs/experiments/heads_ab.py src/specfork/drafts/smollm2-135m-eagle3 drafts/eagle3-stage9 16 2
"""

import sys
import time

from specfork import LLM, SamplingParams
from specfork.datasets import encode, load_prompts
from specfork.outputs import aggregate_metrics

ALONE = {"mode": "sd", "k": 5, "lookup_first": 0, "draft_confidence": 0.0, "lookup_corpus": "none", "threads": 2}
DEFAULTS = {"mode": "sd", "k": "auto", "lookup_first": 2, "draft_confidence": 0.3, "threads": 2}


def main(old: str, new: str, num_prompts: int, repeats: int) -> None:
    engines = {"ar": LLM(threads=2), "alone-old": LLM(draft=old, **ALONE), "alone-new": LLM(draft=new, **ALONE),
               "sd-old": LLM(draft=old, **DEFAULTS), "sd-new": LLM(draft=new, **DEFAULTS)}
    params = SamplingParams(temperature=0.0, max_tokens=256, ignore_eos=True)
    names = list(engines)
    for dataset in ("humaneval", "sharegpt"):
        prompts = [encode(engines["ar"], p) for p in load_prompts(dataset, "eval", num_prompts)]
        for llm in engines.values():  # warm-up
            llm.generate(prompts[:1], SamplingParams(temperature=0.0, max_tokens=8))
        seconds = dict.fromkeys(engines, 0.0)
        outputs = {name: [] for name in engines}
        for r in range(repeats):
            for i, prompt in enumerate(prompts):
                shift = (r + i) % len(names)  # each engine takes each place in the order in turn
                for name in names[shift:] + names[:shift]:
                    t = time.perf_counter()
                    out = engines[name].generate([prompt], params)[0]
                    seconds[name] += time.perf_counter() - t
                    if r == 0:
                        outputs[name].append(out)
        reference = [o.token_ids for o in outputs["ar"]]
        tokens = sum(len(ids) for ids in reference) * repeats
        for name in names:
            agg = aggregate_metrics(outputs[name]) if name != "ar" else {}
            same = all(o.token_ids == ids for o, ids in zip(outputs[name], reference, strict=True))
            by_position = [round(x, 3) for x in agg.get("acceptance_by_position", [])]
            print(f"{dataset:9s} {name:10s} {tokens / seconds[name]:7.1f} tok/s  {seconds['ar'] / seconds[name]:.3f}x AR  "
                  f"accept {agg.get('mean_accepted_length', float('nan')):.3f}  by position {by_position}  = AR {same}",
                  flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))

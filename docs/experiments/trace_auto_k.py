"""Trace SD's rounds inside a `specfork bench` run: each round's wall time, its tokens, the k auto
choice after it, the acceptance estimate and the measured / modelled overheads, plus the step
costs k auto measured at start-up. Used on the H200 (docs/benchmarks.md, 2026-11-29) to find the
CUDA graph captures that priced k auto's windows too high.

    python docs/experiments/trace_auto_k.py rounds.json bench --device cuda --modes ar,sd,ngram \\
        --datasets humaneval --num-prompts 4 --output-len 256 --sweep k=auto,3 --log-level info

Every round of the warm-up and timed runs is recorded, for every SD and n-gram cell in order
("run": how many k auto tables were measured so far; "auto": whether the cell runs k auto)."""

import json
import sys
import time

from specfork.cli import main
from specfork.speculative import auto_k, sd_step

events = []
costs = []
measured_init = auto_k.AutoK.__init__
execute_round = sd_step.SpeculativeStep.execute


def init(self, step_costs, *args, **kwargs):
    costs.append({"draft_s": step_costs.draft_s, "verify_s": list(step_costs.verify_s),
                  "long_s": [list(x) for x in step_costs.long_s]})
    measured_init(self, step_costs, *args, **kwargs)


def execute(self, batch):
    if batch.is_prefill:
        return execute_round(self, batch)
    t = time.perf_counter()
    out = execute_round(self, batch)
    ak = self.auto_k
    events.append({
        "run": len(costs), "auto": ak is not None, "proposer": type(self.proposer).__name__,
        "s": time.perf_counter() - t, "k": self.k,
        "ks": None if ak is None else ak.current.k,  # k auto's choice for the next round
        "alpha": None if ak is None else ak.alpha,
        "acc": [self._accepted.get(s.seq_id) for s in batch.seqs],
        "n": [len(v.ids) for v in out.values()],
        "ovh": None if ak is None else {f"{b},{k}": v for (b, k), v in ak._overhead.items()},
    })
    return out


if __name__ == "__main__":
    auto_k.AutoK.__init__ = init
    sd_step.SpeculativeStep.execute = execute
    rc = main(sys.argv[2:])
    with open(sys.argv[1], "w") as f:
        json.dump({"costs": costs, "events": events}, f)
    sys.exit(rc)

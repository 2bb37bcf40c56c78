"""Fan-out: how many candidate correction/bonus tokens are pre-drafted per verification outcome.

``F[j]`` is the number of branches cached for the outcome "j drafts accepted" (j = 0..k).
Two allocations:

* ``uniform``: the same F for every outcome;
* ``geometric`` (the paper's capped-geometric allocation): P(n = j) decays roughly
  geometrically in the acceptance rate a, and a cache miss becomes rarer roughly as F^-r, so
  F[j] proportional to a^(j / (1 + r)) minimises misses for a fixed total; rounded, at least 1
  for j = 0, capped at ``cap`` and summing to the budget.
"""

from __future__ import annotations

from specfork.errors import SpecforkError


def uniform_fanout(k: int, f: int) -> list[int]:
    return [f] * (k + 1)


def geometric_fanout(k: int, budget: int, acceptance: float = 0.7, r: float = 1.0, cap: int = 8) -> list[int]:
    """``budget`` branches over k + 1 outcomes, proportional to acceptance^(j / (1 + r))."""
    if budget < 1:
        raise SpecforkError(f"fan-out budget must be >= 1, got {budget}")
    if not 0.0 < acceptance < 1.0:
        raise SpecforkError(f"acceptance for the geometric fan-out must be in (0, 1), got {acceptance}")
    weights = [acceptance ** (j / (1.0 + r)) for j in range(k + 1)]
    total = sum(weights)
    raw = [budget * w / total for w in weights]
    fan = [min(cap, int(x)) for x in raw]
    # Hand out what rounding left, largest remainders first, within the cap.
    order = sorted(range(k + 1), key=lambda j: raw[j] - int(raw[j]), reverse=True)
    left = budget - sum(fan)
    while left > 0 and any(f < cap for f in fan):
        for j in order:
            if left and fan[j] < cap:
                fan[j] += 1
                left -= 1
    fan[0] = max(fan[0], 1)
    return fan


def parse_fanout(spec: str | list[int] | None, k: int) -> list[int]:
    """A fan-out list from a config value: a list of k + 1 ints, ``"3"`` (uniform),
    ``"3,2,2,1,1,1"`` (explicit) or ``"geometric:18"`` (capped-geometric over 18 branches)."""
    if spec is None:
        return uniform_fanout(k, 3)
    if isinstance(spec, str):
        text = spec.strip()
        if text.startswith("geometric:"):
            try:
                return geometric_fanout(k, int(text.split(":", 1)[1]))
            except ValueError:
                raise SpecforkError(f"fan-out {spec!r}: expected geometric:<total branches>") from None
        try:
            values = [int(x) for x in text.split(",")]
        except ValueError:
            raise SpecforkError(f"fan-out {spec!r}: expected an int, a comma list or geometric:<total>") from None
        spec = values if len(values) > 1 else uniform_fanout(k, values[0])
    fan = [int(x) for x in spec]
    if len(fan) != k + 1:
        raise SpecforkError(f"a fan-out list needs k + 1 = {k + 1} entries (one per outcome), got {len(fan)}")
    if any(f < 0 for f in fan) or sum(fan) < 1:
        raise SpecforkError(f"fan-out entries must be >= 0 with a positive total, got {fan}")
    return fan

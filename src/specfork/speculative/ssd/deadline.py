"""How long the target waits for the drafter's answer before it declares the drafter failed.

A fixed timeout is either too long (a hung drafter stalls every request for it) or too short for
a round that legitimately carries a long prompt to prefill. So by default the timeout follows
the rounds observed so far: ``FACTOR`` times what this round should take, predicted as the
slowest recent answer plus the slowest recent per-token rate times the tokens sent this round,
clamped to [``FLOOR_S``, ``CAP_S``]. Before any round was observed it is ``CAP_S``.

Example: recent answers took at most 20 ms and no round carried many tokens (the rate guess is
1 ms per token); a decode round sending 8 tokens waits max(2, 10 * (0.02 + 0.008)) = 2 s, a round
sending a 1000-token prompt 10 * (0.02 + 1.0) = 10.2 s.
"""

from __future__ import annotations

from collections import deque

FACTOR = 10.0
FLOOR_S = 2.0
CAP_S = 60.0
WINDOW = 64  # rounds remembered
PER_TOKEN_GUESS_S = 1e-3
MANY_TOKENS = 32  # rounds sending at least this many tokens measure the per-token rate


class DrafterDeadline:
    """The timeout of each drafter round: ``fixed_s`` if given, else adaptive (see the module)."""

    def __init__(self, fixed_s: float | None = None) -> None:
        self.fixed_s = fixed_s
        self._answers: deque[float] = deque(maxlen=WINDOW)  # seconds, rounds with few tokens
        self._per_token: deque[float] = deque(maxlen=WINDOW)  # seconds per token, rounds with many

    def timeout(self, num_tokens: int) -> float:
        if self.fixed_s is not None:
            return self.fixed_s
        if not self._answers and not self._per_token:
            return CAP_S
        base = max(self._answers, default=0.0)
        rate = max(self._per_token, default=PER_TOKEN_GUESS_S)
        return min(CAP_S, max(FLOOR_S, FACTOR * (base + rate * num_tokens)))

    def observe(self, wait_s: float, num_tokens: int) -> None:
        """A round that sent ``num_tokens`` new tokens was answered after ``wait_s`` seconds."""
        if num_tokens >= MANY_TOKENS:
            self._per_token.append(wait_s / num_tokens)
        else:
            self._answers.append(wait_s)

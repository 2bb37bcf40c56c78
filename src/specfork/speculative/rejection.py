"""Lossless verification of proposed tokens (speculative sampling).

Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", and Chen
et al. 2023. For one sequence with proposals x_1..x_n drawn from draft distributions q_1..q_n,
and target distributions p_1..p_{n+1} (after the very same temperature/top-k/top-p filter):

* accept x_i with probability min(1, p_i(x_i) / q_i(x_i)), in order, stopping at the first
  rejection; say m tokens are accepted;
* if m < n, emit a *recovered* token drawn from norm(max(0, p_{m+1} - q_{m+1}));
* if m == n, emit a *bonus* token drawn from p_{n+1}.

The emitted tokens are distributed exactly as sampling from the target one token at a time.
A proposal that was not sampled from a distribution (n-gram lookup, a cached guess) is verified
as a one-hot q: accept x with probability p(x), else draw from p with x removed.

Greedy requests accept while x_i == argmax p_i and emit argmax p_{m+1}.

Worked example (V = 3, n = 1): q_1 = [0.2, 0.7, 0.1], p_1 = [0.5, 0.3, 0.2]. A token t is
proposed with q(t) and kept with min(1, p(t)/q(t)), so it is emitted by acceptance with
min(p, q) = [0.2, 0.3, 0.1] (total 0.6). With the remaining 0.4 the recovered token is drawn
from max(0, p - q) / 0.4 = [0.75, 0, 0.25]. Emitted: [0.2 + 0.3, 0.3 + 0, 0.1 + 0.1] = p_1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specfork.sampling import draw_uniforms, sample_from_probs
from specfork.sampling_params import SamplingParams


@dataclass(slots=True)
class VerifyResult:
    num_accepted: int  # m: proposals accepted
    tokens: list[int]  # x_1..x_m followed by the recovered or bonus token (m + 1 tokens)


def verify_greedy(target_argmax: list[int], proposed: list[int]) -> VerifyResult:
    """target_argmax: argmax of p_1..p_{n+1} (n + 1 ids); proposed: x_1..x_n."""
    m = 0
    while m < len(proposed) and proposed[m] == target_argmax[m]:
        m += 1
    return VerifyResult(m, proposed[:m] + [target_argmax[m]])


def verify_sampled(
    target_probs: torch.Tensor,  # [n + 1, V] p_1..p_{n+1}
    proposed: torch.Tensor,  # [n] int64 x_1..x_n
    draft_probs: torch.Tensor | None,  # [n, V] q_1..q_n, or None: every proposal is one-hot
    generator: torch.Generator,
) -> VerifyResult:
    """Speculative sampling for one sequence. Consumes n + 1 uniforms from ``generator``
    whatever the outcome, so a seeded request stays reproducible."""
    n = proposed.shape[0]
    rows = torch.arange(n, device=target_probs.device)
    p_x = target_probs[rows, proposed]
    q_x = torch.ones_like(p_x) if draft_probs is None else draft_probs[rows, proposed]
    u = torch.rand(n, generator=generator, device=target_probs.device)
    # accept while u * q(x) <= p(x), i.e. u <= p/q (q(x) > 0 since x was drawn from q); never a token
    # the target's filter removed (p(x) = 0), even where the uniform is exactly 0
    accepted = ((u * q_x <= p_x) & (p_x > 0)).to(torch.int64)
    m = int(accepted.cumprod(0).sum()) if n else 0
    if m < n:
        if draft_probs is None:
            residual = target_probs[m].clone()
            residual[proposed[m]] = 0.0
        else:
            residual = (target_probs[m] - draft_probs[m]).clamp_min_(0.0)
        if float(residual.sum()) <= 0.0:  # p == q exactly: rejection had probability 0
            residual = target_probs[m]
    else:
        residual = target_probs[n]
    last = int(sample_from_probs(residual.unsqueeze(0), [generator])[0])
    return VerifyResult(m, proposed[:m].tolist() + [last])


def verify_sampled_logits(
    target_logits: torch.Tensor,  # [n + 1, V] float32 on the CPU, unfiltered
    params: SamplingParams,
    proposed: torch.Tensor,  # [n] int64 x_1..x_n
    draft_probs: torch.Tensor | None,  # [n, V] q_1..q_n, or None: every proposal is one-hot
    generator: torch.Generator,
    kernels,
) -> VerifyResult:
    """``verify_sampled`` in the native kernel (``csrc/sampling.cpp``'s verify_logit_rows), from the
    target's logits and the request's temperature, top-k and top-p: p(x) only for the rows
    verification reaches, filtered and summed in a few passes each, and one row written out, where
    it stops, for the residual (a bonus token is drawn straight from the logits). The same uniforms
    are consumed (n, then one for the last token), the same rule applied; the kernel's exponential
    is within 2 ulp of PyTorch's, so a decision within rounding of its boundary may fall the other
    way, and the distribution is the same."""
    n = proposed.shape[0]
    u = torch.rand(n, generator=generator)
    last = draw_uniforms([generator], target_logits.device)
    q = torch.empty(0) if draft_probs is None else draft_probs.float().contiguous()
    m, token = kernels.verify_logit_rows(target_logits.contiguous(), float(params.temperature), int(params.top_k),
                                         float(params.top_p), proposed.contiguous(), q, u, float(last[0])).tolist()
    return VerifyResult(m, proposed[:m].tolist() + [token])

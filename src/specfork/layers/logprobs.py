"""Log-probabilities reported to users: the model's own distribution at a position, i.e. the
log-softmax of its raw logits, before any temperature, top-k or top-p (which only shape how a
token is drawn). AR, SD and SSD all report these numbers from the target's logits, so the same
tokens get the same log-probabilities in every mode."""

from __future__ import annotations

import torch


def token_logprobs(
    logits: torch.Tensor,  # [N, V] raw logits of the positions that produced ``tokens``
    tokens: torch.Tensor,  # [N] int64, the token chosen at each position
    top: int,  # alternatives wanted per position (0: none)
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chosen [N], top_ids [N, top], top_logprobs [N, top]), all computed in float32.
    (``DecoderStack::decode_steps`` in ``csrc/decoder_layer.cpp`` runs these same ops on each
    reporting row inside its call: change both together; tests/test_decode_steps.py compares them.)

    Example: logits [[0, ln 3]] and token 1 give chosen [ln(3/4)]; with top=2 the alternatives
    are ids [[1, 0]] with log-probabilities [[ln(3/4), ln(1/4)]].
    """
    logp = logits.float().log_softmax(dim=-1)
    chosen = logp.gather(1, tokens.view(-1, 1).to(logp.device)).squeeze(1)
    k = min(top, logp.shape[-1])
    if k > 0:
        values, ids = logp.topk(k, dim=-1)
    else:
        values = logp.new_empty(logp.shape[0], 0)
        ids = torch.empty(logp.shape[0], 0, dtype=torch.long, device=logp.device)
    return chosen, ids, values

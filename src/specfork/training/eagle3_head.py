"""A trainable EAGLE-3 head and its training-time-test (TTT) loss.

The head's forward is the inference head's (``specfork.models.eagle3``), over a padded batch of
sequences instead of a paged cache. For position t with the target's features f_t and the next
token x_{t+1}:

    h = fc(f_t)                      (unrolled steps: the head's own previous output instead)
    a = [input_layernorm(embed(x_{t+1})), hidden_norm(h)]                  (2d wide)
    h1 = h + o_proj(attention(a))    (RoPE at t, causal, grouped-query)
    out = h1 + down(silu(gate(x)) * up(x)),  x = post_attention_layernorm(h1)
    logits = lm_head(norm(out))      (draft vocabulary; predicts x_{t+2})

TTT unrolls ``steps`` passes. Step 0 is that causal pass over the sequence. Step j >= 1 feeds
the query at index t the step j-1 output at t, the token x_{t+1+j} and RoPE position t+j; it
attends to step 0's keys at indices <= t and to the keys of steps 1..j at index t only: what a
chain drafted at decode time sees. Step j predicts x_{t+2+j}; its loss, weighed 0.8^j, is the
cross-entropy against the target's distribution over the draft vocabulary at that position.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from specfork.layers.rotary import rope_inv_freq
from specfork.loading.eagle3 import Eagle3Config
from specfork.models.config import ModelArchConfig

STEP_DECAY = 0.8  # step j's loss weight is STEP_DECAY ** j
INIT_STD = 0.02


class RMSNorm(nn.Module):
    """A trainable RMSNorm with the inference layer's math (statistics in float32)."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def _linear(in_features: int, out_features: int) -> nn.Linear:
    return nn.Linear(in_features, out_features, bias=False)


class Attention(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        d, hd = arch.hidden_size, arch.head_dim
        self.heads, self.kv_heads, self.head_dim = arch.num_heads, arch.num_kv_heads, hd
        self.q_proj = _linear(2 * d, self.heads * hd)
        self.k_proj = _linear(2 * d, self.kv_heads * hd)
        self.v_proj = _linear(2 * d, self.kv_heads * hd)
        self.o_proj = _linear(self.heads * hd, d)


class MLP(nn.Module):
    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_proj = _linear(hidden, intermediate)
        self.up_proj = _linear(hidden, intermediate)
        self.down_proj = _linear(intermediate, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class MidLayer(nn.Module):
    def __init__(self, arch: ModelArchConfig) -> None:
        super().__init__()
        eps = arch.rms_norm_eps
        self.input_layernorm = RMSNorm(arch.hidden_size, eps)
        self.hidden_norm = RMSNorm(arch.hidden_size, eps)
        self.self_attn = Attention(arch)
        self.post_attention_layernorm = RMSNorm(arch.hidden_size, eps)
        self.mlp = MLP(arch.hidden_size, arch.intermediate_size)


KeyValue = tuple[torch.Tensor, torch.Tensor]  # keys, values [B, kv_heads, W, head_dim] (keys rotated)


class Eagle3TrainHead(nn.Module):
    """The head's trainable weights, named as the checkpoint names them (``state_dict`` is what
    ``save_eagle3`` writes), over the target's frozen embedding ``embedding`` [vocab, d].
    ``draft_ids`` [N]: the target id of each draft id."""

    def __init__(self, arch: ModelArchConfig, target_hidden_size: int, embedding: torch.Tensor,
                 draft_ids: torch.Tensor) -> None:
        super().__init__()
        self.arch = arch
        d = arch.hidden_size
        self.fc = _linear(3 * target_hidden_size, d)
        self.midlayer = MidLayer(arch)
        self.norm = RMSNorm(d, arch.rms_norm_eps)
        self.lm_head = _linear(d, len(draft_ids))
        self.register_buffer("embedding", embedding.detach().float(), persistent=False)
        self.register_buffer("draft_ids", draft_ids.to(torch.long), persistent=False)
        self.register_buffer("inv_freq", rope_inv_freq(arch.head_dim, arch.rope_theta, arch.rope_scaling),
                             persistent=False)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, std=INIT_STD)
            elif not name.endswith("norm.weight"):
                raise AssertionError(f"unexpected parameter {name}")

    def project(self, features: torch.Tensor) -> torch.Tensor:
        """Target features [..., 3 d_target] -> the head's input hidden [..., d]."""
        return self.fc(features.float())

    def step(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor,
             cache: list[KeyValue]) -> tuple[torch.Tensor, KeyValue]:
        """One pass: hidden [B, W, d], tokens (x_{t+1+j}) and positions [B, W], ``cache`` the
        keys/values of the earlier steps (empty for step 0). Returns the output before the final
        norm, [B, W, d], and this step's keys/values."""
        m, attn = self.midlayer, self.midlayer.self_attn
        a = torch.cat([m.input_layernorm(self.embedding[tokens]), m.hidden_norm(hidden)], dim=-1)
        cos, sin = self._rope(positions)
        q = _rotate(_heads(attn.q_proj(a), attn.heads), cos, sin)
        k = _rotate(_heads(attn.k_proj(a), attn.kv_heads), cos, sin)
        v = _heads(attn.v_proj(a), attn.kv_heads)
        h = hidden + attn.o_proj(ttt_attention(q, k, v, cache))
        return h + m.mlp(m.post_attention_layernorm(h)), (k, v)

    def logits(self, out: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits of outputs ``out`` [..., d]."""
        return self.lm_head(self.norm(out))

    def _rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.unsqueeze(-1).float() * self.inv_freq  # [B, W, head_dim / 2]
        emb = torch.cat([freqs, freqs], dim=-1).unsqueeze(1)  # [B, 1, W, head_dim]
        return emb.cos(), emb.sin()


def _heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, W, heads * D] -> [B, heads, W, D]."""
    b, w, _ = x.shape
    return x.view(b, w, heads, -1).transpose(1, 2)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """HF's rotate-half RoPE."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


def ttt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cache: list[KeyValue]) -> torch.Tensor:
    """Attention of step ``len(cache)``: q [B, H, W, D], k/v [B, KV, W, D] -> [B, W, H * D].

    Step 0 (empty cache): causal over the sequence. Step j: the sequence keys are step 0's
    (``cache[0]``, indices <= t), plus, at index t only, the keys of steps 1..j (``cache[1:]``
    and this step's own)."""
    sequence, diagonal = (cache[0], [*cache[1:], (k, v)]) if cache else ((k, v), [])
    b, h, w, d = q.shape
    rep = h // k.shape[1]
    q = q * (1.0 / math.sqrt(d))
    seq_k, seq_v = (x.repeat_interleave(rep, dim=1) for x in sequence)
    scores = q @ seq_k.transpose(-1, -2)  # [B, H, W, W]
    causal = torch.ones(w, w, dtype=torch.bool, device=q.device).triu(1)
    scores = scores.masked_fill(causal, float("-inf"))
    diag_v = [dv.repeat_interleave(rep, dim=1) for _, dv in diagonal]
    diag_scores = [(q * dk.repeat_interleave(rep, dim=1)).sum(-1, keepdim=True) for dk, _ in diagonal]
    probs = torch.cat([scores, *diag_scores], dim=-1).float().softmax(-1).to(q.dtype)
    out = probs[..., :w] @ seq_v
    for i, dv in enumerate(diag_v):
        out = out + probs[..., w + i : w + i + 1] * dv
    return out.transpose(1, 2).reshape(b, w, h * d)


@dataclass(frozen=True, slots=True)
class Batch:
    """Padded sequences (right padding), on the training device."""

    ids: torch.Tensor  # [B, W] int64 (0 past a sequence's end)
    features: torch.Tensor  # [B, W, 3 d_target]
    hidden: torch.Tensor  # [B, W, d] the target's final normed hidden states
    lengths: torch.Tensor  # [B]
    prompt_lens: torch.Tensor  # [B]


@dataclass(slots=True)
class TTTResult:
    loss: torch.Tensor  # the weighted sum of the steps' mean losses (0 when nothing is predicted)
    step_loss: list[float]  # per step: summed cross-entropy over its predictions
    correct: list[int]  # per step: predictions whose argmax is the target's token
    counted: list[int]  # per step: predictions (response tokens inside the sequence)
    accepted: int  # over positions with a step-0 prediction: the run of correct steps from step 0, summed
    positions: int  # those positions


@torch.no_grad()
def _target_distributions(batch: Batch, target_rows: torch.Tensor, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The target's distributions over the draft vocabulary at the positions u whose next token
    is a response token inside the sequence, [U, N], computed once for every step; and
    [B, W + steps + 1], the row of each (b, u) among them (-1 elsewhere)."""
    b, w = batch.ids.shape
    index = torch.arange(w + steps + 1, device=batch.ids.device)
    mask = (index + 1 >= batch.prompt_lens[:, None]) & (index + 1 < batch.lengths[:, None])
    where = torch.full(mask.shape, -1, dtype=torch.long, device=mask.device)
    where[mask] = torch.arange(int(mask.sum()), device=mask.device)
    rows, cols = mask[:, :w].nonzero(as_tuple=True)
    with torch.autocast(batch.ids.device.type, enabled=False):  # the target's logits in float32
        return (batch.hidden[rows, cols].float() @ target_rows.T).softmax(-1), where


def ttt_loss(head: Eagle3TrainHead, batch: Batch, target_rows: torch.Tensor, steps: int) -> TTTResult:
    """The TTT loss of ``batch``; ``target_rows`` [N, d] are the target's LM-head rows of the
    draft vocabulary (the target's distribution at a position is softmax(hidden @ rows^T))."""
    b, w = batch.ids.shape
    device = batch.ids.device
    ids = F.pad(batch.ids, (0, steps + 1))
    index = torch.arange(w, device=device)
    target, target_row = _target_distributions(batch, target_rows, steps)
    hidden = head.project(batch.features)
    cache: list[KeyValue] = []
    total = hidden.sum() * 0.0  # differentiable even for a batch with nothing to predict
    result = TTTResult(total, [], [], [], 0, 0)
    run = torch.ones(b, w, dtype=torch.bool, device=device)
    accepted = torch.zeros(b, w, dtype=torch.long, device=device)
    for j in range(steps):
        out, kv = head.step(hidden, ids[:, 1 + j : 1 + j + w], (index + j).expand(b, w), cache)
        cache.append(kv)
        predicted = index + 2 + j  # the index of the token step j predicts at query index t
        mask = (predicted >= batch.prompt_lens[:, None]) & (predicted < batch.lengths[:, None])
        rows, cols = mask.nonzero(as_tuple=True)
        logits = head.logits(out[rows, cols]).float()
        with torch.no_grad():
            hit = head.draft_ids[logits.argmax(-1)] == ids[rows, cols + 2 + j]
        losses = F.cross_entropy(logits, target[target_row[rows, cols + 1 + j]], reduction="none")
        if losses.numel():
            total = total + STEP_DECAY**j * losses.mean()
        correct = torch.zeros(b, w, dtype=torch.bool, device=device)
        correct[rows, cols] = hit
        if j == 0:
            result.positions = int(mask.sum())
        run &= correct
        accepted += run
        result.step_loss.append(float(losses.detach().sum()))
        result.correct.append(int(hit.sum()))
        result.counted.append(int(losses.numel()))
        hidden = out
    result.loss = total
    result.accepted = int(accepted.sum())
    return result


def head_config(target_arch: ModelArchConfig, draft_vocab_size: int, feature_layers: tuple[int, ...],
                intermediate_size: int | None = None) -> Eagle3Config:
    """A head for ``target_arch``: one Llama layer of the target's width, heads and RoPE."""
    arch = replace(target_arch, architecture="llama", num_layers=1, tie_word_embeddings=False, qkv_bias=False,
                   qk_norm=False, intermediate_size=intermediate_size or target_arch.intermediate_size)
    return Eagle3Config(arch=arch, draft_vocab_size=draft_vocab_size, feature_layers=tuple(feature_layers),
                        target_hidden_size=target_arch.hidden_size)


@torch.no_grad()
def target_head_rows(model, ids: torch.Tensor) -> torch.Tensor:
    """[len(ids), d] float32: the rows ``ids`` of the target's LM head (a specfork
    LlamaForCausalLM). A block-quantised head keeps no dense weight; its rows are then read as
    its outputs for the unit vectors."""
    weight = getattr(model.lm_head, "weight", None)
    if isinstance(weight, torch.Tensor):
        return weight[ids.to(weight.device)].float().cpu()
    d = model.config.hidden_size
    unit = torch.eye(d, dtype=model.embed_tokens.weight.dtype, device=model.embed_tokens.weight.device)
    columns = [model.lm_head(unit[i : i + 256])[:, ids.to(unit.device)] for i in range(0, d, 256)]
    return torch.cat(columns).T.float().cpu().contiguous()


def build_head(target, config: Eagle3Config, draft_ids: torch.Tensor,
               rows: torch.Tensor | None = None) -> Eagle3TrainHead:
    """A new head for ``target`` (a specfork LoadedModel): the LM head starts as the target's
    rows of the draft vocabulary (``rows``, when the caller already has them from
    :func:`target_head_rows`), the final norm as the target's; the rest small and random (from
    torch's global generator)."""
    model = target.model
    head = Eagle3TrainHead(config.arch, config.target_hidden_size, model.embed_tokens.weight.detach().cpu(), draft_ids)
    with torch.no_grad():
        head.lm_head.weight.copy_(target_head_rows(model, draft_ids) if rows is None else rows)
        head.norm.weight.copy_(model.norm.weight.detach().float().cpu())
    return head

"""The speculative-decoding step: propose with a drafter, verify all proposals in one target
forward pass, accept losslessly, and roll both KV caches back to the accepted tokens."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specfork.engine.logprobs import logprob_entries
from specfork.engine.model_runner import ModelRunner
from specfork.engine.scheduler import ScheduledBatch
from specfork.engine.sequence import Sequence
from specfork.engine.step import NewTokens, StepHealth, decode_steps_for, run_decode_steps, sample_new_tokens
from specfork.sampling import adjust_logits_, filtered_probs, greedy_tokens, native_sampler
from specfork.speculative.auto_k import AutoK
from specfork.speculative.proposer import Proposal, Proposer
from specfork.speculative.rejection import verify_greedy, verify_sampled, verify_sampled_logits


@dataclass
class SpecStats:
    """Speculation counters of one request."""

    rounds: int = 0
    rounds_without_drafts: int = 0  # plain forwards (k auto chose 0, or nothing to propose)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    accepted_by_position: list[int] = field(default_factory=list)
    proposed_by_position: list[int] = field(default_factory=list)
    draft_time_s: float = 0.0
    target_time_s: float = 0.0
    by_source: dict[str, dict[str, int]] = field(default_factory=dict)  # source -> rounds, proposed, accepted
    # (output tokens before it, tokens it produced, whether each token was a plain round of its own)
    last_round: tuple[int, int, bool] = (0, 0, False)

    def record(self, proposed: int, accepted: int, draft_s: float, target_s: float, source: str | None = None) -> None:
        self.rounds += 1
        self.rounds_without_drafts += proposed == 0
        if source is not None:
            counts = self.by_source.setdefault(source, {"rounds": 0, "proposed": 0, "accepted": 0})
            counts["rounds"] += 1
            counts["proposed"] += proposed
            counts["accepted"] += accepted
        self.proposed += proposed
        self.accepted += accepted
        self.emitted += accepted + 1
        for pos in range(proposed):
            if pos >= len(self.proposed_by_position):
                self.proposed_by_position.append(0)
                self.accepted_by_position.append(0)
            self.proposed_by_position[pos] += 1
            self.accepted_by_position[pos] += int(pos < accepted)
        self.draft_time_s += draft_s
        self.target_time_s += target_s

    def end(self, num_output_tokens: int) -> None:
        """The request finished with ``num_output_tokens``: a stop (EOS, a stop string or id) in its
        last round dropped the tokens after it, which are not emitted. The drafts' acceptance
        (accepted, by position) still counts what the target verified; plain rounds of the dropped
        tokens (several decode steps in one call) are not counted."""
        before, produced, plain = self.last_round
        dropped = max(0, produced - (num_output_tokens - before))
        self.emitted -= dropped
        if plain:
            self.rounds -= dropped
            self.rounds_without_drafts -= dropped
        self.last_round = (num_output_tokens, 0, False)

    def as_metrics(self) -> dict:
        return {
            "spec_rounds": self.rounds,
            "spec_rounds_without_drafts": self.rounds_without_drafts,
            "spec_tokens_emitted": self.emitted,
            "draft_tokens_proposed": self.proposed,
            "draft_tokens_accepted": self.accepted,
            "acceptance_rate": self.accepted / self.proposed if self.proposed else None,
            "mean_accepted_length": self.emitted / self.rounds if self.rounds else None,
            "acceptance_by_position": [
                a / p if p else None for a, p in zip(self.accepted_by_position, self.proposed_by_position, strict=True)
            ],
            "accepted_by_position": list(self.accepted_by_position),
            "proposed_by_position": list(self.proposed_by_position),
            "draft_time_s": self.draft_time_s,
            "target_time_s": self.target_time_s,
            "by_source": {s: dict(c) for s, c in self.by_source.items()},
        }


class SpeculativeStep:
    """One round per decode step: each sequence gets up to ``k`` proposals verified together."""

    def __init__(self, target: ModelRunner, proposer: Proposer, *, k: int, max_model_len: int,
                 auto_k: AutoK | None = None, decode_steps: int = 1) -> None:
        """With ``auto_k``, each round proposes the number of tokens it currently chooses (at most
        ``k``); a round where it chooses none for the whole batch decodes up to ``decode_steps``
        tokens in one native call, as plain decoding does (at most k + 1: the slots a round reserves)."""
        self.target = target
        self.proposer = proposer
        self.k = k
        self.auto_k = auto_k
        self.lookahead = k
        self.max_model_len = max_model_len
        self.plain_steps = min(decode_steps, k + 1) if target.decodes_in_one_call else 1
        self._accepted: dict[int, int] = {}  # seq_id -> drafts accepted in its last round
        if proposer.feature_layers:
            target.capture_features(proposer.feature_layers)

    def execute(self, batch: ScheduledBatch) -> dict[Sequence, NewTokens]:
        if batch.is_prefill:
            return self._plain_pass(batch)
        seqs = batch.seqs
        ks = self.auto_k.ks_for_round(len(seqs)) if self.auto_k is not None else [self.k] * len(seqs)
        t0 = time.perf_counter()
        if not any(ks):  # k auto chose plain decoding (SSD's k is fixed: its drafter hears of every round)
            limit = self.plain_steps if self.auto_k is None else min(self.plain_steps, self.auto_k.plain_rounds())
            steps = decode_steps_for(batch, limit, self.target, self.max_model_len)
            out = self._plain_pass(batch) if steps == 1 else self._plain_steps(seqs, steps)
            seconds = time.perf_counter() - t0
            for seq in seqs:
                self._accepted[seq.seq_id] = 0
                stats = _spec_stats(seq)
                for _ in range(steps):  # a plain round per token, as one step a call counts them
                    stats.record(0, 0, 0.0, seconds / steps)
                stats.last_round = (seq.num_output_tokens, steps, True)
            if self.auto_k is not None:
                self.auto_k.end_round(ks, seconds, rounds=steps)  # a plain round per token, as one step a call
            return out
        asked = [self._budget(s, k) for s, k in zip(seqs, ks, strict=True)]
        proposal = self.proposer.propose(seqs, asked)
        t1 = time.perf_counter()
        logits = self._score(seqs, proposal)
        t2 = time.perf_counter()
        # Verified as AR samples: each row after its request's adjustments, the drafts before it included.
        raw = adjust_logits_(logits, [s.history(props) for s, props in zip(seqs, proposal.tokens, strict=True)])
        results, spans = self._verify(seqs, proposal, logits)
        draft_s, target_s = t1 - t0, t2 - t1
        # The last committed token and the accepted proposals: the positions the target keeps.
        self._share_features(seqs, [s.num_cached_tokens for s in seqs],
                             [(first, 1 + r.num_accepted) for (first, _), r in zip(spans, results, strict=True)])
        out = {}
        sources = proposal.sources or [None] * len(seqs)
        for i, (seq, props, result, (first, _), source, budget) in enumerate(zip(seqs, proposal.tokens, results, spans,
                                                                                sources, asked, strict=True)):
            # The last committed token and the accepted proposals are now in the target cache.
            seq.num_cached_tokens += 1 + result.num_accepted
            self._accepted[seq.seq_id] = result.num_accepted
            stats = _spec_stats(seq)
            stats.record(len(props), result.num_accepted, draft_s, target_s, source)
            stats.last_round = (seq.num_output_tokens, len(result.tokens), False)
            if self.auto_k is not None:
                self.auto_k.observe(budget, result.num_accepted)  # a position left empty yields nothing
            logprobs = None
            if seq.params.logprobs is not None:
                # Row first + j of the verify pass is the target's distribution for token j.
                rows = (raw[i] if i in raw else logits[first:])[: len(result.tokens)]
                logprobs = logprob_entries(rows, result.tokens, seq.params.logprobs)
            out[seq] = NewTokens(result.tokens, logprobs)
        if self.auto_k is not None:
            self.auto_k.end_round(ks, time.perf_counter() - t0)
        return out

    def _plain_pass(self, batch: ScheduledBatch) -> dict[Sequence, NewTokens]:
        """A pass that verifies nothing (a prefill, or a round without proposals): the target's
        logits sampled as AR samples them, its features handed to the proposer."""
        starts = [s.num_cached_tokens for s in batch.seqs]
        logits = self.target.run_batch(batch)
        self._share_features(batch.seqs, starts, _spans(batch.num_new_tokens))
        sampling = [s for s, samples in zip(batch.seqs, batch.samples, strict=True) if samples]
        return sample_new_tokens(logits, sampling) if sampling else {}

    def _plain_steps(self, seqs: list[Sequence], steps: int) -> dict[Sequence, NewTokens]:
        """``steps`` plain decode steps in one native call, their features handed to the proposer."""
        starts = [s.num_cached_tokens for s in seqs]
        out = run_decode_steps(self.target, seqs, steps)
        self._share_features(seqs, starts, _spans([steps] * len(seqs)))
        return out

    def committed(self, seq: Sequence) -> None:
        """The engine appended this round's tokens to ``seq``."""
        num_accepted = self._accepted.pop(seq.seq_id, None)
        if num_accepted is not None:  # None after a prefill: nothing was proposed
            self.proposer.accepted(seq, num_accepted)

    def release(self, seq: Sequence) -> None:
        if seq.finish_reason is not None and _STATS in seq.stats:
            seq.stats[_STATS].end(seq.num_output_tokens)
        self._accepted.pop(seq.seq_id, None)
        self.proposer.release(seq)

    def usable_prefix(self, seq: Sequence, num_tokens: int) -> int:
        """As far as the proposer can follow (a proposer that does not say: not at all)."""
        usable = getattr(self.proposer, "usable_prefix", None)
        return 0 if usable is None else usable(seq, num_tokens)

    def adopt_prefix(self, seq: Sequence, num_tokens: int) -> None:
        self.proposer.adopt_prefix(seq, num_tokens)

    def close(self) -> None:
        close = getattr(self.proposer, "close", None)
        if close is not None:
            close()

    def health(self) -> StepHealth:
        health = getattr(self.proposer, "health", None)
        return health() if health is not None else StepHealth()

    def idle(self) -> None:
        idle = getattr(self.proposer, "idle", None)
        if idle is not None:
            idle()

    def _share_features(self, seqs: list[Sequence], positions: list[int], rows: list[tuple[int, int]]) -> None:
        """Hand the proposer the target's features of the kept positions: ``rows[i]`` = (first flat
        row of the last pass, count) for ``seqs[i]``, whose first kept position is ``positions[i]``."""
        features = self.target.features
        if not self.proposer.feature_layers or features is None:
            return
        for seq, position, (first, count) in zip(seqs, positions, rows, strict=True):
            self.proposer.observe_features(seq, position, features[first : first + count])

    def _budget(self, seq: Sequence, k: int) -> int:
        """Proposals worth verifying: never past max_tokens or the context length."""
        left = min(seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - len(seq))
        return max(0, min(k, left - 1))

    def _score(self, seqs: list[Sequence], proposal: Proposal) -> torch.Tensor:
        """Target logits of every verify position, [sum(n_i + 1), V]: one forward over the last
        committed token followed by the proposals of each sequence."""
        starts = [s.num_cached_tokens for s in seqs]
        feeds = [s.token_ids[st:] + props for s, st, props in zip(seqs, starts, proposal.tokens, strict=True)]
        rows = list(range(sum(len(f) for f in feeds)))
        return self.target.forward(seqs, starts, feeds, rows)

    def _verify(self, seqs: list[Sequence], proposal: Proposal, logits: torch.Tensor):
        spans = _spans([len(props) + 1 for props in proposal.tokens])  # (first logits row, rows) per sequence
        sampled = [i for i, s in enumerate(seqs) if not s.params.greedy]
        # A sampled request is verified from its logits by the native kernel (when built); otherwise
        # every verify position is filtered with the request's own settings first, as AR sampling does.
        kernels = native_sampler(logits) if sampled else None
        filtered = sampled if kernels is None else []
        target_probs = {}
        if filtered:
            idx = torch.cat([torch.arange(spans[i][0], sum(spans[i])) for i in filtered]).to(logits.device)
            per_row = [seqs[i] for i in filtered for _ in range(spans[i][1])]
            probs = filtered_probs(logits.index_select(0, idx), [s.params for s in per_row])
            target_probs = dict(zip(filtered, probs.split([spans[i][1] for i in filtered]), strict=True))
        argmax = greedy_tokens(logits) if len(sampled) < len(seqs) else None
        results = []
        for i, (seq, props) in enumerate(zip(seqs, proposal.tokens, strict=True)):
            first, rows = spans[i]
            if seq.params.greedy:
                results.append(verify_greedy(argmax[first : first + rows], props))
                continue
            q = None if proposal.probs is None else proposal.probs[i, : len(props)]
            proposed = torch.tensor(props, dtype=torch.long, device=logits.device)
            if kernels is not None:
                results.append(verify_sampled_logits(logits[first : first + rows], seq.params, proposed, q, seq.generator,
                                                     kernels))
            else:
                results.append(verify_sampled(target_probs[i], proposed, q, seq.generator))
        return results, spans


_STATS = "spec"  # the key of SpecStats in Sequence.stats


def _spec_stats(seq: Sequence) -> SpecStats:
    """The request's speculation counters (created on its first round, not built every round)."""
    stats = seq.stats.get(_STATS)
    if stats is None:
        stats = seq.stats[_STATS] = SpecStats()
    return stats


def _spans(counts: list[int]) -> list[tuple[int, int]]:
    """(first flat row, rows) of consecutive runs of ``counts`` rows."""
    spans, offset = [], 0
    for n in counts:
        spans.append((offset, n))
        offset += n
    return spans

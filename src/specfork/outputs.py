"""What a finished request returns."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    """The target model's log-probability of one token at its position, and the ``top`` most
    likely tokens there (best first). Log-probabilities are the log-softmax of the model's raw
    logits: the model's own distribution, before any penalty, bias, temperature, top-k or top-p."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class RequestOutput:
    """token_ids are the generated tokens only (EOS included when it ended the request).

    ``logprobs`` (when the request asked for them) has one entry per generated token;
    ``prompt_logprobs`` one per prompt token from the second on (the first has no context).
    """

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str  # "stop" (EOS, stop token or stop string), "length", "abort" or "error"
    metrics: dict = field(default_factory=dict)
    logprobs: list[TokenLogprob] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


def aggregate_metrics(outputs: list[RequestOutput]) -> dict:
    """Totals over requests: tokens, and for speculative runs the pooled acceptance figures."""
    m = [o.metrics for o in outputs]
    agg = {
        "num_requests": len(m),
        "num_prompt_tokens": sum(x["num_prompt_tokens"] for x in m),
        "num_generated_tokens": sum(x["num_generated_tokens"] for x in m),
    }
    spec = [x for x in m if x.get("spec_rounds")]
    if spec:
        proposed = sum(x["draft_tokens_proposed"] for x in spec)
        accepted = sum(x["draft_tokens_accepted"] for x in spec)
        rounds = sum(x["spec_rounds"] for x in spec)
        emitted = sum(x["spec_tokens_emitted"] for x in spec)
        agg.update(
            spec_rounds=rounds,
            spec_rounds_without_drafts=sum(x["spec_rounds_without_drafts"] for x in spec),
            draft_tokens_proposed=proposed,
            draft_tokens_accepted=accepted,
            acceptance_rate=accepted / proposed if proposed else None,
            mean_accepted_length=emitted / rounds,  # tokens a round emitted (a stop may cut its last)
            draft_time_s=sum(x["draft_time_s"] for x in spec),
            target_time_s=sum(x["target_time_s"] for x in spec),
            acceptance_by_position=_pooled_by_position(spec),
        )
        by_source = _pooled_by_source(spec)
        if by_source:
            agg["by_source"] = by_source
    ssd = [x for x in m if x.get("ssd_requests")]
    if ssd:
        requests = sum(x["ssd_requests"] for x in ssd)
        hits = sum(x["ssd_cache_hits"] for x in ssd)
        drafter_s = sum(x["ssd_drafter_s"] for x in ssd)
        waited = sum(x["draft_time_s"] for x in ssd)
        agg.update(
            ssd_requests=requests,
            ssd_cache_hits=hits,
            ssd_cache_hit_rate=hits / requests,
            ssd_hidden_fraction=max(0.0, 1.0 - waited / drafter_s) if drafter_s else None,
        )
    return agg


def _pooled_by_source(metrics: list[dict]) -> dict[str, dict]:
    """Rounds, proposed and accepted drafts per proposal source ("lookup", "draft") where a proposer
    combines several, pooled over requests."""
    pooled: dict[str, dict] = {}
    for m in metrics:
        for source, counts in m.get("by_source", {}).items():
            p = pooled.setdefault(source, {"rounds": 0, "proposed": 0, "accepted": 0})
            for key in p:
                p[key] += counts[key]
    return pooled


def _pooled_by_position(metrics: list[dict]) -> list[float]:
    """Accepted / proposed draft tokens at each chain position, pooled over requests."""
    accepted: list[int] = []
    proposed: list[int] = []
    for m in metrics:
        for i, (a, p) in enumerate(zip(m.get("accepted_by_position", ()), m.get("proposed_by_position", ()),
                                       strict=True)):
            if i == len(proposed):
                accepted.append(0)
                proposed.append(0)
            accepted[i] += a
            proposed[i] += p
    return [a / p for a, p in zip(accepted, proposed, strict=True) if p]

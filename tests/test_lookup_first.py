"""Prompt lookup first, the draft elsewhere (``--lookup-first N``): which source proposes, the q
each proposal carries, greedy output equal to AR with a head and with a draft model, and the
target's exact distribution when sampling with both sources in play."""

from __future__ import annotations

import pytest
import torch
from eagle3_heads import HEAD_DRAFT_IDS as DRAFT_IDS
from lossless import NUM_TOKENS, PROMPT, SETTINGS, check, exact_joint, marginal, sampling_params

from specfork import LLM, SamplingParams
from specfork.config import Config
from specfork.engine.sequence import Sequence
from specfork.errors import SpecforkError
from specfork.outputs import aggregate_metrics
from specfork.speculative.lookup_first import LookupFirstProposer
from specfork.speculative.proposer import Proposal, StatelessProposer

V = 10


class FixedDraft(StatelessProposer):
    """Proposes [7, 8, 9][:k] with q = uniform over 8 tokens for sampled sequences."""

    def __init__(self) -> None:
        self.asked: list[list[int]] = []

    def propose(self, seqs, num_tokens):
        self.asked.append([s.seq_id for s in seqs])
        tokens = [[7, 8, 9][:k] for k in num_tokens]
        probs = [None if s.params.greedy else torch.full((len(t), V), 1 / 8) for s, t in zip(seqs, tokens, strict=True)]
        return Proposal.of(tokens, probs, V, torch.device("cpu"))


def _seq(seq_id: int, tokens: list[int], temperature: float) -> Sequence:
    return Sequence(seq_id, tokens, SamplingParams(temperature=temperature), torch.Generator())


def test_a_repeated_ngram_is_looked_up_and_the_rest_drafted_with_their_q():
    draft = FixedDraft()
    proposer = LookupFirstProposer(draft, min_n=2, max_n=4)
    seqs = [
        _seq(0, [1, 2, 3, 4, 1, 2], 1.0),  # [1, 2] occurred: lookup proposes 3, 4, 1
        _seq(1, [1, 2, 3, 4, 5, 6], 1.0),  # no repeated 2-gram: drafted
        _seq(2, [5, 1, 5, 1], 0.0),  # greedy lookup: what followed [5, 1], the repetition continued
        _seq(3, [1, 2, 3, 3], 1.0),  # only a 1-gram repeats: below min_n, drafted
    ]
    proposal = proposer.propose(seqs, [3, 2, 3, 1])
    assert proposal.tokens == [[3, 4, 1], [7, 8], [5, 1, 5], [7]]
    assert draft.asked == [[1, 3]]  # the draft saw only the sequences without a lookup
    assert proposal.probs is not None
    assert torch.equal(proposal.probs[0], torch.eye(V)[[3, 4, 1]])  # a lookup is a one-hot q
    assert torch.allclose(proposal.probs[1, :2], torch.full((2, V), 1 / 8))
    assert torch.allclose(proposal.probs[3, :1], torch.full((1, V), 1 / 8))
    assert proposal.sources == ["lookup", "draft", "lookup", "draft"]


def test_only_lookups_or_greedy_drafts_need_no_q():
    proposer = LookupFirstProposer(FixedDraft(), min_n=1, max_n=4)
    assert proposer.propose([_seq(0, [4, 4], 1.0)], [2]) == Proposal([[4, 4]], None, ["lookup"])
    greedy = proposer.propose([_seq(1, [1, 2], 0.0), _seq(2, [3, 3, 5], 0.0)], [2, 0])
    assert greedy.tokens == [[7, 8], []] and greedy.probs is None
    assert greedy.sources == ["draft", None]  # a zero budget is neither looked up nor drafted


@pytest.mark.parametrize("options, message", [
    (dict(mode="ar", lookup_first=2), "--mode sd --drafter draft"),
    (dict(mode="sd", drafter="ngram", lookup_first=2), "--drafter ngram"),
    (dict(mode="ssd", lookup_first=2), "--mode sd"),
    (dict(mode="sd", lookup_first=5), "must not exceed ngram_max"),
    (dict(mode="sd", lookup_first=-1), "integer >= 0"),
    (dict(mode="sd", lookup_first=True), "integer >= 0"),
])
def test_lookup_first_is_refused_where_it_means_nothing(options, message):
    with pytest.raises(SpecforkError, match=message.replace("-", r"\-")):
        Config(**options)


@pytest.mark.parametrize("options, confidence, lookup", [
    (dict(mode="sd"), 0.3, 2),  # the shipped draft: its measured settings
    (dict(mode="sd", draft="default", ngram_max=1), 0.3, 1),
    (dict(mode="sd", draft="smollm2-135m-eagle3"), 0.3, 2),  # the shipped head by name: the same
    (dict(mode="sd", draft="smollm2-135m-draft"), 0.0, 0),  # the other shipped draft: plain
    (dict(mode="sd", draft_confidence=0.0, lookup_first=0), 0.0, 0),  # asked for: kept
    (dict(mode="sd", draft="path/to/my-head", draft_confidence=0.5), 0.5, 0),  # another draft: plain
    (dict(mode="sd", draft="path/to/my-draft"), 0.0, 0),
    (dict(mode="sd", drafter="ngram"), 0.0, 0),
    (dict(mode="ssd"), 0.0, 0),
    (dict(mode="ar"), 0.0, 0),
])
def test_sd_defaults_are_the_shipped_drafts_measured_settings(options, confidence, lookup):
    config = Config(**options)
    assert (config.head_confidence, config.lookup_first_n) == (confidence, lookup)


def test_sd_on_the_embedded_model_runs_the_measured_settings():
    """`--mode sd` alone: prompt lookup of 2 tokens before the shipped head, whose chains stop below
    a confidence of 0.3."""
    from specfork.speculative.eagle3_proposer import Eagle3Proposer

    with LLM(mode="sd") as llm:
        proposer = llm.engine.step_strategy.proposer
        assert isinstance(proposer, LookupFirstProposer) and proposer.lookup.min_n == 2
        assert isinstance(proposer.draft, Eagle3Proposer) and proposer.draft.min_confidence == 0.3


@pytest.mark.parametrize("drafter", ["head", "draft model"])
@pytest.mark.parametrize("k, n", [(2, 1), (4, 2)])
def test_greedy_sd_with_lookup_first_equals_ar(head_pair, draft_pair, drafter, k, n):
    models = head_pair if drafter == "head" else draft_pair
    prompts = [PROMPT * 2, [2, 4], [6, 1, 1, 0, 3, 6, 1], [5]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(models["target"], deterministic=True).generate(prompts, params)]
    llm = LLM(models["target"], mode="sd", draft=models["draft"], k=k, lookup_first=n, deterministic=True)
    for batch in ([prompts[0]], prompts):  # batch 1 and 4
        outs = llm.generate(batch, params)
        assert [o.token_ids for o in outs] == expected[: len(batch)]
    # Both sources proposed, and their drafts add up to the requests' (rounds with no budget left,
    # at a request's end, have no source).
    by_source = aggregate_metrics(outs)["by_source"]
    assert by_source["lookup"]["rounds"] > 0 and by_source["draft"]["rounds"] > 0
    for key, total in (("proposed", "draft_tokens_proposed"), ("accepted", "draft_tokens_accepted")):
        assert sum(c[key] for c in by_source.values()) == sum(o.metrics[total] for o in outs)
    assert sum(c["rounds"] for c in by_source.values()) <= sum(o.metrics["spec_rounds"] for o in outs)


def test_sampling_with_lookups_and_a_reduced_vocabulary_head_is_lossless(head_pair):
    params_kw = SETTINGS["temperature"]
    joint = exact_joint(head_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    outside = sum(p for tokens, p in marginal(joint, (0,)).items() if tokens[0] not in DRAFT_IDS)
    assert outside > 0.1  # the target really produces tokens the head cannot propose
    n = 6000
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, lookup_first=2, max_num_seqs=512,
              kv_cache_tokens=512 * 16)
    outs = llm.generate([PROMPT] * n, [sampling_params(i, params_kw) for i in range(n)])
    by_source = aggregate_metrics(outs)["by_source"]
    assert by_source["lookup"]["rounds"] > n // 10 and by_source["draft"]["rounds"] > n // 10
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    assert 0 < accepted < proposed
    for name, (stat, dof, limit) in check([tuple(o.token_ids) for o in outs], joint).items():
        assert stat < limit, f"{name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"

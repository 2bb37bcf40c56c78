"""SSD with an EAGLE-3 head: the drafter process reads the target's features (one round late),
pre-drafts its branches on the head's own outputs, equals AR greedily and is lossless when
sampling from a reduced draft vocabulary, with cache hits and misses."""

from __future__ import annotations

import pytest
import torch
from eagle3_heads import HEAD_DRAFT_IDS as DRAFT_IDS
from eagle3_heads import plain_head, write_tiny_head
from lossless import NUM_TOKENS, PROMPT, SETTINGS, check, exact_joint, marginal, sample_ssd

from specfork import LLM, SamplingParams
from specfork.errors import SpecforkError
from specfork.loading.eagle3 import load_eagle3_head, read_eagle3_config
from specfork.speculative.ssd.drafter import DrafterCore
from specfork.speculative.ssd.messages import DrafterSettings, SpecRequest

pytestmark = pytest.mark.dist

def test_every_branch_is_the_heads_chain_on_its_own_outputs(tiny_checkpoints, tmp_path):
    """The drafter, given the target's features of a prompt, answers with the head's chain and
    caches, for each outcome (j, c), exactly what the head drafts after rec, x1..xj, c when
    every position past the prompt reads the head's own output (checked against a plain
    reimplementation of the head); the features of the verified positions, sent with the next
    request, replace the head's stand-ins."""
    target_dir = tiny_checkpoints["llama-gqa-tied"].path
    draft_ids = list(range(0, 256, 2))
    tensors = write_tiny_head(tmp_path / "head", target_dir, draft_ids=draft_ids, seed=9, scale=4.0)
    target = LLM(str(target_dir), weights="fp32").engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"))
    settings = DrafterSettings(k=3, fanout_hit=(2, 2, 2, 2), fanout_miss=(2, 2, 2, 2), block_size=4, num_blocks=256,
                               vocab_size=256)
    core = DrafterCore(head, settings, torch.device("cpu"))
    arch, embed = read_eagle3_config(tmp_path / "head").arch, target.model.embed_tokens.weight
    to_draft = {t: i for i, t in enumerate(draft_ids)}
    gen = torch.Generator().manual_seed(0)
    context = [1, 17, 40, 3, 99, 12, 8]  # the pending rec last
    features = torch.randn(len(context) - 1, 3 * 64, generator=gen)
    greedy = SamplingParams(temperature=0.0)

    def chain(context, features, forced):
        """The plain head's greedy continuation of ``context + forced``, rows past the features on
        its own outputs; None where a near-tie makes the argmax ambiguous."""
        hidden = features @ tensors["fc.weight"].T
        ids, out = list(context[1:]), []
        for token in forced + [None] * settings.k:
            logits, own = plain_head(tensors, embed, arch, hidden, torch.tensor(ids), torch.arange(len(ids)))
            if token is None:
                top = logits[-1].topk(2).values
                if top[0] - top[1] < 1e-3:
                    return None
                token = draft_ids[int(logits[-1].argmax())]
                out.append(token)
            hidden = torch.cat([hidden, own[-1:]])
            ids.append(token)
        return out

    reply = core.speculate([SpecRequest(0, context, None, greedy, 3, features.numpy(), 0)])[0]
    assert reply.source == "jit" and reply.tokens == chain(context, features, [])
    core.prepare_next()
    entries = dict(core.cache.entries)
    assert len(entries) == 8
    checked = 0
    for (_, j, c), entry in entries.items():
        assert all(t in to_draft for t in entry.tokens)
        expected = chain(context, features, reply.tokens[:j] + [c])
        if expected is not None:
            assert entry.tokens == expected[: settings.k], (j, c)
            checked += 1
    assert checked >= 6
    # The next round: the target accepted x1 and corrected to a cached candidate; it sends the
    # features of the two verified positions (rec and x1).
    (j, c), entry = next(((j, c), e) for (_, j, c), e in entries.items() if j == 1)
    verified = torch.randn(2, 3 * 64, generator=gen)
    request = SpecRequest(0, reply.tokens[:1] + [c], 1, greedy, 3, verified.numpy(), len(context) - 1)
    again = core.speculate([request])[0]
    assert again.source == "hit" and again.tokens == entry.tokens
    core.prepare_next()
    context2, features2 = context + [reply.tokens[0], c], torch.cat([features, verified])
    for (_, j2, c2), entry2 in core.cache.entries.items():
        expected = chain(context2, features2, again.tokens[:j2] + [c2])
        assert expected is None or entry2.tokens == expected[: settings.k], (j2, c2)
    # Features that do not follow the last ones: the sequence gets no more drafts from the head.
    stray = SpecRequest(0, [5], None, greedy, 3, verified.numpy(), 3)
    assert core.speculate([stray])[0].source == "fast"


def test_sampled_branches_are_drawn_over_the_draft_vocabulary_and_reply_over_the_targets(tiny_checkpoints, tmp_path):
    """At temperature > 0 the tree decode samples over the head's draft vocabulary and the cache
    keeps q there; a hit replies with q over the target's vocabulary, zero at every id the head
    cannot propose, each row a distribution that gives its token positive probability."""
    target_dir = tiny_checkpoints["llama-gqa-tied"].path
    draft_ids = list(range(0, 256, 2))
    write_tiny_head(tmp_path / "head", target_dir, draft_ids=draft_ids, seed=9, scale=1.0)
    target = LLM(str(target_dir), weights="fp32").engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"))
    settings = DrafterSettings(k=3, fanout_hit=(2, 2, 2, 2), fanout_miss=(2, 2, 2, 2), block_size=4, num_blocks=256,
                               vocab_size=256, saguaro=0.5)
    core = DrafterCore(head, settings, torch.device("cpu"))
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=3)
    context = [1, 17, 40, 3, 99, 12, 8]
    features = torch.randn(len(context) - 1, 3 * 64, generator=torch.Generator().manual_seed(0))
    outside = torch.ones(256, dtype=torch.bool)
    outside[draft_ids] = False

    def check_reply(reply):
        assert reply.probs.shape == (len(reply.tokens), 256)
        assert not reply.probs[:, outside].any()
        assert torch.allclose(reply.probs.sum(dim=-1), torch.ones(len(reply.tokens)))
        assert all(reply.probs[i, t] > 0 for i, t in enumerate(reply.tokens))

    reply = core.speculate([SpecRequest(0, context, None, params, 3, features.numpy(), 0)])[0]
    assert reply.source == "jit"
    check_reply(reply)
    core.prepare_next()
    entries = dict(core.cache.entries)
    assert entries and all(e.probs.shape == (3, len(draft_ids)) for e in entries.values())
    (j, c), entry = next(((j, c), e) for (_, j, c), e in entries.items() if j == 1)
    verified = torch.randn(2, 3 * 64, generator=torch.Generator().manual_seed(1))
    hit = core.speculate([SpecRequest(0, reply.tokens[:1] + [c], 1, params, 3, verified.numpy(), len(context) - 1)])[0]
    assert hit.source == "hit" and hit.tokens == entry.tokens
    check_reply(hit)
    assert torch.equal(hit.probs[:, draft_ids], entry.probs)


@pytest.mark.parametrize("k, backup", [(1, "jit"), (3, "fast"), (5, "jit")])
def test_greedy_ssd_with_a_head_equals_ar(head_pair, k, backup):
    prompts = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5]]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in LLM(head_pair["target"], deterministic=True).generate(prompts, params)]
    with LLM(head_pair["target"], mode="ssd", draft=head_pair["draft"], k=k, backup=backup, deterministic=True) as llm:
        assert llm.engine.step_strategy.proposer.feature_layers == (0, 1, 1)
        for batch in ([prompts[0]], prompts):  # batch 1 and 4
            outs = llm.generate(batch, params)
            assert [o.token_ids for o in outs] == expected[: len(batch)]
        assert llm.engine.step_strategy.proposer.failure is None
    hits = sum(o.metrics["ssd_cache_hits"] for o in outs)
    assert 0 < hits < sum(o.metrics["ssd_requests"] for o in outs)
    assert sum(o.metrics["draft_tokens_proposed"] for o in outs) > 0


def test_sequences_in_flight_when_a_head_drafter_dies_are_asked_for_no_drafts_after_the_restart(head_pair):
    """Their earlier features died with the drafter, so the restarted one could only guess by
    n-gram lookup (a few percent accepted, each guess a verify row); new sequences get the head."""
    import time

    prompts = [PROMPT, [6, 1, 1, 0, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = [o.token_ids for o in LLM(head_pair["target"], deterministic=True).generate(prompts, params)]
    with LLM(head_pair["target"], mode="ssd", draft=head_pair["draft"], k=3, deterministic=True) as llm:
        engine, proposer = llm.engine, llm.engine.step_strategy.proposer
        seqs = [engine.add_request(p, params) for p in prompts]
        for _ in range(3):
            engine.step()
        proposer.process.kill()
        while proposer.failures == 0:
            engine.step()
        seqs.append(engine.add_request(prompts[0], params))  # prefilled while no drafter runs
        engine.step()
        proposer._restart_at = 0.0  # no backoff: restart now
        deadline = time.monotonic() + 60
        while proposer.drafter is None and time.monotonic() < deadline:
            proposer._restart_if_due()
            time.sleep(0.05)
        assert proposer.restarts == 1
        proposed = [engine.output(s).metrics.get("draft_tokens_proposed", 0) for s in seqs]
        while any(not s.is_finished for s in seqs):
            engine.step()
        assert [engine.output(s).token_ids for s in seqs] == [*expected, expected[0]]
        assert [engine.output(s).metrics["draft_tokens_proposed"] for s in seqs] == proposed
        fresh = llm.generate([prompts[0]], params)[0]
        assert fresh.token_ids == expected[0] and fresh.metrics["draft_tokens_proposed"] > 0


def test_a_head_needs_the_fast_tree_backend(head_pair):
    with pytest.raises(SpecforkError, match="tree-backend sdpa runs draft models only"):
        LLM(head_pair["target"], mode="ssd", draft=head_pair["draft"], tree_backend="sdpa")


@pytest.mark.parametrize("backup, setting, saguaro", [  # the default run keeps two; `-m slow` runs the others
    ("jit", "temperature", None), ("jit", "temperature", 0.5),  # Saguaro's reshape over the draft vocabulary
    pytest.param("fast", "top-p", None, marks=pytest.mark.slow),
    pytest.param("jit", "top-k", None, marks=pytest.mark.slow)])
def test_ssd_with_a_reduced_vocabulary_head_is_lossless(head_pair, backup, setting, saguaro):
    params_kw = SETTINGS[setting]
    joint = exact_joint(head_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    outside = sum(p for tokens, p in marginal(joint, (0,)).items() if tokens[0] not in DRAFT_IDS)
    assert outside > 0.1  # the target really produces tokens the head cannot propose
    samples = sample_ssd(head_pair, params_kw, backup, saguaro, 6000)  # asserts hits, misses, acceptances, rejections
    for name, (stat, dof, limit) in check(samples, joint).items():
        assert stat < limit, f"{backup} {setting} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"

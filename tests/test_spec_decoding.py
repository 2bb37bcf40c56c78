"""Speculative decoding: greedy output equals AR output, KV rollback, metrics, drafter checks."""

import dataclasses
import json

import pytest
import torch
from builders import build_tiny_checkpoint
from helpers import assert_greedy_match

from specfork import LLM, ModelLoadError, SamplingParams, SpecforkError
from specfork.engine.sequence import Sequence
from specfork.outputs import aggregate_metrics
from specfork.speculative.ngram import NgramIndex, NgramProposer, ngram_lookup
from specfork.speculative.rejection import verify_greedy

PROMPTS = [[1, 5, 9, 13, 2, 7, 30, 31], [1, 44, 3], [1, 8, 8, 8, 8, 8, 8, 8, 8, 20, 21], [1, 60, 61, 62, 63, 64],
           [1, 100, 7, 100, 7, 100]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny target, an unrelated draft and a perturbed copy of the target (medium acceptance)."""
    root = tmp_path_factory.mktemp("sd_pair")
    target = build_tiny_checkpoint("llama-gqa-tied", root, seed=21)
    unrelated = build_tiny_checkpoint("qwen3-qknorm-tied", root, seed=22)  # same vocab, other arch
    from safetensors.torch import load_file, save_file

    noisy = root / "noisy"
    noisy.mkdir()
    gen = torch.Generator().manual_seed(5)
    tensors = load_file(str(target.path / "model.safetensors"))
    tensors = {k: v + 0.35 * v.std() * torch.randn(v.shape, generator=gen) for k, v in tensors.items()}
    save_file(tensors, str(noisy / "model.safetensors"), metadata={"format": "pt"})
    (noisy / "config.json").write_text((target.path / "config.json").read_text())
    return {"target": str(target.path), "unrelated": str(unrelated.path), "noisy": str(noisy)}


@pytest.fixture(scope="module")
def ar_outputs(pair):
    llm = LLM(pair["target"], deterministic=True)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


@pytest.mark.parametrize("k", [1, 3, 7])
@pytest.mark.parametrize("draft", ["target", "unrelated", "noisy"])
def test_greedy_sd_equals_ar_deterministic(pair, ar_outputs, k, draft):
    sd = LLM(pair["target"], mode="sd", draft=pair[draft], k=k, deterministic=True, block_size=4)
    batched = sd.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in batched] == ar_outputs
    alone = sd.generate([PROMPTS[0]], GREEDY)[0]
    assert alone.token_ids == ar_outputs[0]
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in batched)
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in batched)
    assert proposed > 0
    if draft == "target":
        assert accepted == proposed, "a draft identical to the target must be accepted every time"
        assert batched[0].metrics["mean_accepted_length"] > k  # k accepted + bonus per round
    elif draft == "unrelated":
        assert accepted / proposed < 0.3
    else:
        assert 0 < accepted < proposed


def test_greedy_sd_ngram_equals_ar(pair, ar_outputs):
    sd = LLM(pair["target"], mode="sd", drafter="ngram", k=4, deterministic=True)
    outs = sd.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == ar_outputs
    assert sum(o.metrics["draft_tokens_proposed"] for o in outs) > 0


def test_continuous_batching_with_mixed_lengths(pair, ar_outputs):
    """Requests with different max_tokens finish mid-flight; later ones keep going correctly."""
    sd = LLM(pair["target"], mode="sd", draft=pair["noisy"], k=3, deterministic=True, max_num_seqs=3)
    params = [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True) for m in (5, 40, 17, 40, 9)]
    outs = sd.generate(PROMPTS, params)
    for o, ref, p in zip(outs, ar_outputs, params, strict=True):
        assert o.token_ids == ref[: p.max_tokens]


def test_sd_with_kv_exhaustion_and_preemption(pair, ar_outputs):
    sd = LLM(pair["target"], mode="sd", draft=pair["noisy"], k=3, deterministic=True, block_size=4,
             num_kv_blocks=28)
    outs = sd.generate(PROMPTS, GREEDY)
    assert sd.engine.scheduler.num_preemptions > 0
    assert [o.token_ids for o in outs] == ar_outputs
    assert sd.engine.block_manager.num_used_blocks == 0
    assert sd.engine.step_strategy.proposer.drafts.blocks.num_used_blocks == 0, "draft blocks leaked"


def test_seeded_sd_at_a_fixed_k_reproduces_its_output_through_preemption(pair):
    """A sequence recomputed after preemption sampled its next token in the prefill, the AR way,
    where a round would have verified drafts: other random numbers, another (equally exact)
    sample. The recompute now stops before the last token, which the next round computes."""
    params = [SamplingParams(temperature=0.9, top_p=0.95, max_tokens=30, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    common = {"mode": "sd", "draft": pair["noisy"], "k": 3, "deterministic": True, "block_size": 4}
    roomy = LLM(pair["target"], **common).generate(PROMPTS, params)
    tight = LLM(pair["target"], num_kv_blocks=28, **common)
    outs = tight.generate(PROMPTS, params)
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the test must exercise preemption"
    assert [o.token_ids for o in outs] == [o.token_ids for o in roomy]


def test_fast_mode_diverges_only_at_near_ties(pair):
    ar = LLM(pair["target"])
    sd = LLM(pair["target"], mode="sd", draft=pair["noisy"], k=5)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for prompt, ours in zip(PROMPTS, sd.generate(PROMPTS, params), strict=True):
        ref = ar.generate([prompt], params)[0].token_ids
        # reference logits along *our* path tell whether a divergence is a genuine near-tie
        logits = _logits_along(ar, prompt, ref)
        assert_greedy_match(ours.token_ids, ref, logits, atol=1e-4, rtol=1e-5)


def _logits_along(llm, prompt, tokens):
    eng = llm.engine
    seq = Sequence(10_000, prompt + tokens, GREEDY, torch.Generator())
    eng.block_manager.grow(seq, len(seq.token_ids))
    try:
        n = len(prompt)
        rows = list(range(n - 1, len(seq.token_ids) - 1))
        return eng.runner.forward([seq], [0], [seq.token_ids[:-1]], rows, decode=False)
    finally:
        eng.block_manager.free(seq)


def test_target_cache_after_rejections_equals_fresh_prefill(pair):
    """KV rollback: after rounds with rejections the next-step logits from the speculative
    engine's cache equal those of a fresh prefill of the accepted sequence."""
    sd = LLM(pair["target"], mode="sd", draft=pair["unrelated"], k=4)
    eng = sd.engine
    seq = eng.add_request(PROMPTS[0], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    for _ in range(6):
        eng.step()
    stats = seq.stats["spec"]
    assert stats.proposed > stats.accepted, "the test needs rejections"
    # next step from the speculative engine's cache (only the uncached last token is fed)
    cached = eng.runner.forward([seq], [seq.num_cached_tokens], [seq.token_ids[seq.num_cached_tokens:]], [0])
    fresh = _logits_along(LLM(pair["target"]), seq.token_ids, [0])[:1]  # row predicting the next token
    assert seq.num_cached_tokens == len(seq.token_ids) - 1
    torch.testing.assert_close(cached, fresh, atol=1e-5, rtol=1e-5)
    eng.abort(seq)


@pytest.mark.parametrize("draft", ["target", "noisy"])
def test_draft_cache_tracks_the_sequence_and_rolls_back(pair, draft):
    """A draft that is the target is always accepted, and its cache then holds every committed
    token but the last two (its own last proposal, never fed back, and the bonus token); a noisy
    draft is sometimes rejected, and its cache is rolled back to what the sequence committed
    (never past it, never emptied)."""
    sd = LLM(pair["target"], mode="sd", draft=pair[draft], k=4, deterministic=True)
    eng = sd.engine
    seq = eng.add_request(PROMPTS[1], SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    eng.step()  # prefill
    rejected = False
    for _ in range(5):
        eng.step()
        state = eng.step_strategy.proposer._states[seq.seq_id]
        stats = seq.stats["spec"]
        rejected |= stats.accepted < stats.proposed
        assert 0 < state.num_cached_tokens <= len(seq.token_ids) - 1
        if draft == "target":
            assert stats.accepted == stats.proposed > 0
            assert state.num_cached_tokens == len(seq.token_ids) - 2
    assert rejected == (draft == "noisy")
    eng.abort(seq)
    assert seq.seq_id not in eng.step_strategy.proposer._states


def test_sd_metrics_in_outputs(pair):
    sd = LLM(pair["target"], mode="sd", draft=pair["noisy"], k=3)
    out = sd.generate([PROMPTS[0]], GREEDY)[0]
    m = out.metrics
    for key in ("draft_tokens_proposed", "draft_tokens_accepted", "acceptance_rate", "mean_accepted_length",
                "acceptance_by_position", "draft_time_s", "target_time_s", "spec_rounds"):
        assert key in m, key
    assert len(m["acceptance_by_position"]) == 3
    assert m["mean_accepted_length"] == pytest.approx(
        (m["draft_tokens_accepted"] + m["spec_rounds"]) / m["spec_rounds"])
    assert m["spec_tokens_emitted"] == len(out.token_ids) - 1 and m["spec_rounds_without_drafts"] == 0
    # tokens = 1 from prefill + emitted by rounds (the last round may be cut by max_tokens)
    assert m["spec_rounds"] <= 40


def test_vocabulary_mismatch_is_refused(pair, tmp_path):
    cfg = json.loads((__import__("pathlib").Path(pair["target"]) / "config.json").read_text())
    small = build_tiny_checkpoint("llama-gqa-tied", tmp_path, seed=3)
    cfg_small = json.loads((small.path / "config.json").read_text())
    assert cfg_small["vocab_size"] == cfg["vocab_size"]
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other_vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(other)
    with pytest.raises(ModelLoadError, match="vocabulary"):
        LLM(pair["target"], mode="sd", draft=str(other))
    padded = tmp_path / "padded_vocab"
    LlamaForCausalLM(LlamaConfig(vocab_size=cfg["vocab_size"] + 64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1)).save_pretrained(padded)
    sd = LLM(pair["target"], mode="sd", draft=str(padded), k=2, deterministic=True)
    ref = LLM(pair["target"], deterministic=True).generate([PROMPTS[0]], GREEDY)[0].token_ids
    assert sd.generate([PROMPTS[0]], GREEDY)[0].token_ids == ref


def test_sd_config_errors(pair):
    with pytest.raises(SpecforkError, match="no default draft .* pass a draft model"):
        LLM(pair["target"], mode="sd")
    with pytest.raises(SpecforkError, match="mode"):
        LLM(pair["target"], mode="fast")
    with pytest.raises(SpecforkError, match="k must"):
        LLM(pair["target"], mode="sd", drafter="ngram", k=0)


def test_ngram_lookup_examples():
    assert ngram_lookup([1, 2, 3, 9, 1, 2], min_n=1, max_n=3, k=3) == [3, 9, 1]
    assert ngram_lookup([1, 2, 3], min_n=1, max_n=3, k=3) == []
    # a copy that runs into the context's end goes on from its own start (the period repeats)
    assert ngram_lookup([1, 2, 3, 9, 1, 2], min_n=1, max_n=3, k=5) == [3, 9, 1, 2, 3]
    assert ngram_lookup([0, 5, 6, 5, 6], min_n=1, max_n=4, k=3) == [5, 6, 5]
    assert ngram_lookup([4, 4], min_n=1, max_n=4, k=3) == [4, 4, 4]
    # the longest n-gram wins over a more recent shorter match
    assert ngram_lookup([7, 8, 5, 6, 1, 8, 9, 7, 8], min_n=1, max_n=2, k=2) == [5, 6]
    assert ngram_lookup([7, 8, 5, 6, 1, 8, 9, 7, 8], min_n=1, max_n=1, k=2) == [9, 7]
    seq = Sequence(0, [4, 5, 6, 4, 5], GREEDY, torch.Generator())
    assert NgramProposer(min_n=1, max_n=3).propose([seq], [2]).tokens == [[6, 4]]


def _ngram_lookup_by_definition(tokens, min_n, max_n, k):
    """The latest earlier window equal to the longest suffix (max_n down to min_n), by brute force;
    its continuation copied token by token from the context extended by the copy itself."""
    for n in range(min(max_n, len(tokens) - 1), min_n - 1, -1):
        for start in range(len(tokens) - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[len(tokens) - n :]:
                extended = list(tokens)
                for i in range(k):
                    extended.append(extended[start + n + i])
                return extended[len(tokens) :]
    return []


def test_ngram_lookup_equals_its_definition_on_random_contexts():
    gen = torch.Generator().manual_seed(5)
    for trial in range(400):
        length = int(torch.randint(1, 60, (1,), generator=gen))
        vocab = 2 + trial % 6  # small vocabularies: many repeats and long matches
        tokens = torch.randint(0, vocab, (length,), generator=gen).tolist()
        for min_n, max_n, k in ((1, 4, 5), (2, 3, 2), (1, 1, 1), (3, 5, 4)):
            assert ngram_lookup(tokens, min_n=min_n, max_n=max_n, k=k) == \
                _ngram_lookup_by_definition(tokens, min_n, max_n, k), (tokens, min_n, max_n, k)


def test_ngram_index_follows_a_growing_context():
    """The index a sequence keeps from round to round proposes what the definition proposes for
    the context of every round, however many tokens each round appends."""
    gen = torch.Generator().manual_seed(6)
    for trial in range(60):
        vocab = 2 + trial % 5
        tokens = torch.randint(0, vocab, (80,), generator=gen).tolist()
        for min_n, max_n, k in ((1, 4, 5), (2, 3, 2), (3, 5, 4)):
            index, length = NgramIndex(min_n=min_n, max_n=max_n), 1
            while length <= len(tokens):
                context = tokens[:length]
                assert index.propose(context, k) == _ngram_lookup_by_definition(context, min_n, max_n, k), \
                    (context, min_n, max_n, k)
                length += 1 + int(torch.randint(0, 4, (1,), generator=gen))
    with pytest.raises(ValueError, match="shorter"):
        index.propose(tokens[:3], 2)


def test_verify_greedy():
    assert verify_greedy([5, 6, 7, 8], [5, 6, 9]).tokens == [5, 6, 7]
    assert verify_greedy([5, 6, 7, 8], [5, 6, 7]).tokens == [5, 6, 7, 8]
    assert verify_greedy([4], []).tokens == [4]
    assert verify_greedy([1, 2], [3]).num_accepted == 0


def test_tokens_a_stop_drops_from_an_accepted_run_are_not_counted_as_emitted(pair):
    """The draft is the target, so every round accepts all k = 5 and emits 6; a stop id inside a
    round dropped the rest of it, which mean_accepted_length still counted."""
    sd = LLM(pair["target"], mode="sd", draft=pair["target"], k=5)
    plain = sd.generate([PROMPTS[0]], GREEDY)[0].token_ids
    cut = next(i for i in range(2, len(plain)) if plain.index(plain[i]) == i and i % 6)
    out = sd.generate([PROMPTS[0]], dataclasses.replace(GREEDY, stop_token_ids=(plain[cut],)))[0]
    assert out.token_ids == plain[: cut + 1] and out.finish_reason == "stop"
    m = out.metrics
    assert m["mean_accepted_length"] * m["spec_rounds"] == pytest.approx(len(out.token_ids) - 1)  # 1 from prefill
    assert m["spec_tokens_emitted"] == len(out.token_ids) - 1
    assert m["draft_tokens_accepted"] == m["draft_tokens_proposed"]  # what the target verified still counts
    assert aggregate_metrics([out])["mean_accepted_length"] == m["mean_accepted_length"]

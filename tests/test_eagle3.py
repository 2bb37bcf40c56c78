"""EAGLE-3 heads: the ecosystem's checkpoint layout loads and computes the head's formula; SD
with a head (reduced draft vocabulary, adaptive chain) equals AR greedily and is lossless when
sampling, including tokens the head cannot propose."""

from __future__ import annotations

import json

import pytest
import torch
from eagle3_heads import HEAD_DRAFT_IDS as DRAFT_IDS
from eagle3_heads import plain_head, plain_head_logits, write_tiny_head
from lossless import NUM_TOKENS, PROMPT, SETTINGS, VOCAB, check, exact_joint, marginal, sampling_params
from safetensors.torch import load_file, save_file

from specfork import LLM, SamplingParams
from specfork.engine.block_manager import BlockManager
from specfork.engine.model_runner import ModelRunner
from specfork.errors import SpecforkError
from specfork.loading.eagle3 import load_eagle3_head, read_eagle3_config
from specfork.speculative.draft_runner import DraftState


@pytest.fixture(scope="module")
def tiny_target(tiny_checkpoints):
    return tiny_checkpoints["llama-gqa-tied"].path


def _head_logits_paged(head, features, next_ids, split):
    """The head over a sequence through its paged KV cache: a prefill of the first ``split``
    positions, then one decode step per position."""
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=torch.device("cpu"))
    blocks, state = BlockManager(8, 4), DraftState()
    blocks.grow(state, len(next_ids))
    outs = []
    for start, stop, decode in [(0, split, False)] + [(p, p + 1, True) for p in range(split, len(next_ids))]:
        ids, pos, meta = runner.prepare([state], [start], [next_ids[start:stop]], decode=decode)
        with torch.inference_mode():
            outs.append(head(ids, pos, None, runner.kv_caches, meta, features=features[start:stop],
                             logit_rows=range(stop - start))[1])
    return torch.cat(outs)


def _head_chain_paged(head, features, next_ids, split):
    """A prefill of the first ``split`` positions from the target's features (the logits of its
    last row only), then one decode step per position, from the features and from the head's own
    output of the step before in turn: (every logits row, every output row, the KV cache)."""
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=torch.device("cpu"))
    blocks, state = BlockManager(8, 4), DraftState()
    blocks.grow(state, len(next_ids))
    logits, outs = [], []
    with torch.inference_mode():
        ids, pos, meta = runner.prepare([state], [0], [next_ids[:split]], decode=False)
        out, lg = head(ids, pos, None, runner.kv_caches, meta, features=features[:split], logit_rows=[split - 1])
        logits.append(lg), outs.append(out)
        for p in range(split, len(next_ids)):
            ids, pos, meta = runner.prepare([state], [p], [next_ids[p : p + 1]], decode=True)
            own = (p - split) % 2 == 1
            out, lg = head(ids, pos, out[-1:] if own else None, runner.kv_caches, meta,
                           features=None if own else features[p : p + 1], logit_rows=[0])
            logits.append(lg), outs.append(out)
    return torch.cat(logits), torch.cat(outs), runner.kv_caches[0].clone()


def test_head_in_the_ecosystem_layout_computes_the_eagle3_formula(tiny_target, tmp_path):
    draft_ids = list(range(3, 256, 4))  # 64 of 256 tokens
    tensors = write_tiny_head(tmp_path / "head", tiny_target, draft_ids=draft_ids, seed=5)
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"] and config["draft_vocab_size"] == 64
    stored = load_file(tmp_path / "head" / "model.safetensors")
    assert torch.equal(stored["d2t"] + torch.arange(64), torch.tensor(draft_ids))
    assert stored["t2d"].dtype == torch.bool and stored["t2d"].sum() == 64 and stored["t2d"][draft_ids].all()

    target = LLM(str(tiny_target)).engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"))
    assert head.draft_to_target.tolist() == draft_ids
    assert read_eagle3_config(tmp_path / "head").layers_for(3) == (2, 1, 0)
    gen = torch.Generator().manual_seed(0)
    features = torch.randn(11, 3 * 64, generator=gen)
    next_ids = torch.randint(0, 256, (11,), generator=gen).tolist()
    expected = plain_head_logits(tensors, target.model.embed_tokens.weight, config_arch(tmp_path / "head"), features,
                                 torch.tensor(next_ids), torch.arange(11))
    torch.testing.assert_close(_head_logits_paged(head, features, next_ids, split=8), expected, atol=2e-5, rtol=2e-5)

    # vLLM-style names (layers.0.* for the decoder layer) load to the same head.
    renamed = {k.replace("midlayer.", "layers.0."): v for k, v in stored.items()}
    save_file(renamed, tmp_path / "head" / "model.safetensors")
    again = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"))
    torch.testing.assert_close(_head_logits_paged(again, features, next_ids, split=3), expected, atol=2e-5, rtol=2e-5)


def test_the_proposer_drafts_from_the_targets_features(tiny_target, tmp_path):
    """Each round's chain is the head's formula over the target's real features of the verified
    positions, then over its own outputs (checked against transformers' hidden states)."""
    from transformers import AutoModelForCausalLM

    draft_ids = list(range(0, 256, 2))
    tensors = write_tiny_head(tmp_path / "head", tiny_target, draft_ids=draft_ids, seed=9, scale=4.0)
    llm = LLM(str(tiny_target), mode="sd", draft=str(tmp_path / "head"), k=3, weights="fp32")  # the head unquantised
    proposer = llm.engine.step_strategy.proposer
    rounds = []
    propose = proposer.propose

    def recording(seqs, num_tokens):
        proposal = propose(seqs, num_tokens)
        rounds.extend((list(s.token_ids), t) for s, t in zip(seqs, proposal.tokens, strict=True))
        return proposal

    proposer.propose = recording
    llm.generate([[1, 5, 9, 33, 7]], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    hf = AutoModelForCausalLM.from_pretrained(tiny_target, torch_dtype=torch.float32).eval()
    arch, embed = config_arch(tmp_path / "head"), hf.model.embed_tokens.weight.detach()
    to_draft = {t: i for i, t in enumerate(draft_ids)}
    assert len(rounds) >= 3
    for context, chain in rounds:
        with torch.no_grad():
            states = hf(torch.tensor([context]), output_hidden_states=True).hidden_states
        features = torch.cat([states[i][0] for i in (2, 1, 0)], dim=-1)[:-1]  # positions 0..L-2
        hidden = features @ tensors["fc.weight"].T
        ids = list(context[1:])
        for token in chain:
            logits, out = plain_head(tensors, embed, arch, hidden, torch.tensor(ids), torch.arange(len(ids)))
            best = logits[-1].topk(2).values
            if best[0] - best[1] > 1e-3:  # not a near-tie
                assert to_draft[token] == int(logits[-1].argmax()), (context, chain)
            hidden = torch.cat([hidden, out[-1:]])
            ids.append(token)


def test_the_int4_head_runs_one_call_and_the_fused_layer_bit_for_bit_like_its_modules(tiny_target, tmp_path):
    from specfork.native_kernels import kernels

    if kernels() is None:
        pytest.skip("native kernels not built")
    write_tiny_head(tmp_path / "head", tiny_target, draft_ids=list(range(0, 256, 4)), seed=2)
    target = LLM(str(tiny_target)).engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"), quantize_group=32)
    assert head.fused_decode is not None and head.fused_step is not None
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(9, 3 * 64, generator=gen)
    next_ids = torch.randint(0, 256, (9,), generator=gen).tolist()
    one_call = _head_chain_paged(head, features, next_ids, split=4)  # fc to logits in one call
    head.fused_step = None
    layer_only = _head_chain_paged(head, features, next_ids, split=4)  # the layer in one call
    head.fused_decode = None
    modules = _head_chain_paged(head, features, next_ids, split=4)
    for a, b, c in zip(one_call, layer_only, modules, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)
    assert one_call[0].shape == (1 + 9 - 4, 64)


def test_the_prepared_head_step_reads_weights_whose_storage_was_replaced(tiny_target, tmp_path):
    """The head's one-call step holds its weights, parsed once; an LM head given other values in
    new storage (the old one kept alive, so a stale read would find it) must be read where it now
    lives, as the module path reads it."""
    from specfork.native_kernels import kernels

    if kernels() is None:
        pytest.skip("native kernels not built")
    write_tiny_head(tmp_path / "head", tiny_target, draft_ids=list(range(0, 256, 4)), seed=2)
    target = LLM(str(tiny_target)).engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"), quantize_group=32)
    step, decode = head.fused_step, head.fused_decode
    assert step is not None
    gen = torch.Generator().manual_seed(1)
    features = torch.randn(9, 3 * 64, generator=gen)
    next_ids = torch.randint(0, 256, (9,), generator=gen).tolist()
    before = _head_chain_paged(head, features, next_ids, split=4)
    old = head.lm_head.values.data  # kept alive
    head.lm_head.values.data = torch.flip(old, dims=[0]).contiguous()
    calls = []

    def counted(*args):
        calls.append(1)
        return step(*args)

    head.fused_step = counted
    one_call = _head_chain_paged(head, features, next_ids, split=4)
    assert calls, "the chain did not run the one-call step"
    head.fused_step = head.fused_decode = None
    modules = _head_chain_paged(head, features, next_ids, split=4)
    head.fused_step, head.fused_decode = step, decode
    assert all(torch.equal(a, b) for a, b in zip(one_call, modules, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(one_call, before, strict=True))


def config_arch(path):
    return read_eagle3_config(path).arch


def test_a_head_for_another_target_is_refused(tiny_target, tiny_checkpoints, tmp_path):
    other = tiny_checkpoints["qwen3-qknorm-tied"].path  # hidden 64 but 2 layers: layers 2 and -1 do not exist
    write_tiny_head(tmp_path / "head", tiny_target, draft_ids=list(range(64)))
    for mode in ("sd", "ssd"):  # SSD refuses it before its drafter process starts loading
        with pytest.raises(SpecforkError, match="target layers"):
            LLM(str(other), mode=mode, draft=str(tmp_path / "head"))
    from specfork.layers.quantized import QuantizedLinear
    from specfork.native_kernels import kernels

    head = LLM(str(tiny_target), mode="sd", draft=str(tmp_path / "head")).engine.step_strategy.proposer.head
    if kernels() is not None:  # native weights: the head's projections run the int4 kernel
        assert isinstance(head.mlp.down_proj, QuantizedLinear) and isinstance(head.lm_head, QuantizedLinear)
    head = LLM(str(tiny_target), mode="sd", draft=str(tmp_path / "head"), weights="fp32").engine.step_strategy.proposer.head
    assert not isinstance(head.mlp.down_proj, QuantizedLinear)


GREEDY_PROMPTS = [PROMPT, [2, 4], [6, 1, 1, 0, 3], [5]]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def greedy_ar(head_pair) -> list[list[int]]:
    """The head pair's target decoding GREEDY_PROMPTS by AR in deterministic mode (computed once)."""
    return [o.token_ids for o in LLM(head_pair["target"], deterministic=True).generate(GREEDY_PROMPTS, GREEDY)]


@pytest.mark.parametrize("k, confidence", [(1, 0.0), (3, 0.0), (5, 0.0), (5, 0.3)])
def test_greedy_sd_with_a_head_equals_ar(head_pair, greedy_ar, k, confidence):
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=k, draft_confidence=confidence,
              deterministic=True)
    for batch in ([GREEDY_PROMPTS[0]], GREEDY_PROMPTS):  # batch 1 and 4
        outs = llm.generate(batch, GREEDY)
        assert [o.token_ids for o in outs] == greedy_ar[: len(batch)]
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    assert 0 < accepted < proposed  # the head's proposals were used, and some were wrong
    if confidence:
        assert proposed < k * sum(o.metrics["spec_rounds"] for o in outs)  # chains ended early


def test_a_sequence_that_stops_drafting_catches_up_and_keeps_few_features(head_pair, greedy_ar, monkeypatch):
    """k auto decoding plainly for 12 rounds, then speculating: while plain, each sequence's
    waiting features stay at most MAX_PENDING_FEATURES (it catches up), and drafting afterwards
    still equals AR."""
    from specfork.speculative import auto_k, eagle3_proposer

    monkeypatch.setattr(eagle3_proposer, "MAX_PENDING_FEATURES", 6)
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k="auto", deterministic=True)
    step = llm.engine.step_strategy
    proposer = step.proposer
    rounds = []
    monkeypatch.setattr(auto_k.AutoK, "ks_for_round",
                        lambda self, batch=1: rounds.append(batch) or [0 if len(rounds) <= 12 else 3] * batch)
    waiting, accepted = [], proposer.accepted

    def watch(seq, num_accepted):
        accepted(seq, num_accepted)
        waiting.append(proposer._states[seq.seq_id].num_features)

    monkeypatch.setattr(proposer, "accepted", watch)
    outs = llm.generate(GREEDY_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == greedy_ar
    plain = waiting[: 12 * len(GREEDY_PROMPTS)]
    assert max(plain) <= 6 and 0 in plain  # bounded: caught up every few positions
    assert sum(o.metrics["draft_tokens_proposed"] for o in outs) > 0  # drafting resumed


def test_seeded_sampling_with_a_fixed_k_is_reproducible_and_follows_the_seed(head_pair):
    """What `--k`'s help promises: at a fixed k a seeded SD request draws the same numbers every
    run (k auto may not: its k follows measured times)."""
    prompts = [PROMPT, [2, 4], [6, 1, 1, 0, 3]]

    def sample(seed: int) -> list[list[int]]:
        llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, max_num_seqs=2)
        params = SamplingParams(temperature=1.0, max_tokens=20, ignore_eos=True, seed=seed)
        return [o.token_ids for o in llm.generate(prompts, params)]

    first = sample(5)
    assert sample(5) == first
    assert any(sample(s) != first for s in (6, 7, 8))


def test_a_confidence_floor_can_leave_a_round_without_a_draft(head_pair, greedy_ar):
    """With a floor above most of the head's top probabilities many chains are empty: those rounds
    are plain decode steps, and greedy output still equals AR."""
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, draft_confidence=0.9,
              deterministic=True)
    outs = llm.generate(GREEDY_PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == greedy_ar
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    assert 0 < proposed < sum(o.metrics["spec_rounds"] for o in outs)  # some rounds proposed nothing


@pytest.mark.parametrize("setting, confidence", [(s, 0.0) for s in SETTINGS] + [("temperature", 0.3)])
def test_sd_with_a_reduced_vocabulary_head_is_lossless(head_pair, setting, confidence):
    """Also with a confidence floor: where a chain ends is decided from the head's distribution
    before each draw (deciding from the drawn token would bias the output)."""
    params_kw = SETTINGS[setting]
    joint = exact_joint(head_pair["hf_target"], SamplingParams(**params_kw), NUM_TOKENS)
    outside = sum(p for tokens, p in marginal(joint, (0,)).items() if tokens[0] not in DRAFT_IDS)
    assert outside > 0.1  # the target really produces tokens the head cannot propose
    n = 12000
    llm = LLM(head_pair["target"], mode="sd", draft=head_pair["draft"], k=3, max_num_seqs=512,
              kv_cache_tokens=512 * 16, draft_confidence=confidence)
    outs = llm.generate([PROMPT] * n, [sampling_params(i, params_kw) for i in range(n)])
    accepted = sum(o.metrics["draft_tokens_accepted"] for o in outs)
    proposed = sum(o.metrics["draft_tokens_proposed"] for o in outs)
    assert 0 < accepted < proposed
    rounds = sum(o.metrics["spec_rounds"] for o in outs)
    assert rounds >= 2 * n  # later tokens come from later rounds
    if confidence:
        assert proposed < 0.8 * 3 * rounds  # chains of every length, empty ones too
    for name, (stat, dof, limit) in check([tuple(o.token_ids) for o in outs], joint).items():
        assert stat < limit, f"{setting} {name}: chi2 {stat:.1f} >= {limit:.1f} (dof {dof})"
    assert VOCAB == 8


def test_a_head_joining_late_stops_quietly_and_a_gap_is_a_warning(caplog):
    """A head taking over a sequence in flight (SSD's fallback) never saw its first features: it
    drafts nothing for it, without a warning; a gap after features did arrive is a fault."""
    from specfork.speculative.head_runner import HeadState

    caplog.set_level("DEBUG", logger="specfork.speculative.head_runner")
    late = HeadState()
    late.observe(40, torch.zeros(2, 6), seq_id=1)
    assert late.broken and not late.ready(43)
    assert [r.levelname for r in caplog.records] == ["DEBUG"]
    caplog.clear()
    gap = HeadState()
    gap.observe(0, torch.zeros(5, 6), seq_id=2)
    assert gap.ready(6)
    gap.observe(7, torch.zeros(1, 6), seq_id=2)
    assert gap.broken and not gap.ready(8)
    assert [r.levelname for r in caplog.records] == ["WARNING"]


def test_a_native_forward_refuses_positions_other_than_its_metadatas(tiny_target, tmp_path):
    """The one-call path rotates at the attention metadata's positions; a caller passing other
    positions gets an error, not a silently different rotation."""
    from specfork.native_kernels import kernels

    if kernels() is None:
        pytest.skip("native kernels not built")
    write_tiny_head(tmp_path / "head", tiny_target, draft_ids=list(range(0, 256, 4)), seed=2)
    target = LLM(str(tiny_target)).engine.loaded
    head = load_eagle3_head(tmp_path / "head", target, device=torch.device("cpu"), quantize_group=32)
    runner = ModelRunner(head, num_blocks=8, block_size=4, device=torch.device("cpu"))
    blocks, state = BlockManager(8, 4), DraftState()
    blocks.grow(state, 3)
    ids, pos, meta = runner.prepare([state], [0], [[1, 2, 3]], decode=False)
    features = torch.randn(3, 3 * 64)
    with torch.inference_mode():
        head(ids, pos, None, runner.kv_caches, meta, features=features, logit_rows=[2])  # prepare's positions
        with pytest.raises(ValueError, match="metadata's positions"):
            head(ids, pos.clone(), None, runner.kv_caches, meta, features=features, logit_rows=[2])

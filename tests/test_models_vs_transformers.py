"""specfork's models against transformers on tiny random checkpoints (fp32, CPU).

Logits must match transformers within 1e-4 (max-abs, full vocabulary) on every prompt position
and on each of 32 decode steps, through the engine's own ModelRunner, BlockManager and paged KV
cache, with small blocks so that block boundaries are crossed. Greedy generation through the
public API must match transformers' ``generate`` and must not depend on batching.
"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_match, max_abs_diff
from transformers import AutoModelForCausalLM

from specfork import LLM, SamplingParams
from specfork.engine.sequence import Sequence

LOGITS_ATOL = 1e-4
DECODE_STEPS = 32


def random_prompt(length: int, seed: int, vocab: int = 256) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (length,), generator=gen).tolist()  # no bos/eos (1, 2) inside


@pytest.fixture(scope="module")
def hf_model(tiny_checkpoint):
    model = AutoModelForCausalLM.from_pretrained(
        tiny_checkpoint.path, dtype=torch.float32, attn_implementation="eager"
    )
    return model.eval()


@torch.inference_mode()
def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    """Reference logits [len(tokens), V] of one full causal forward pass (no KV cache)."""
    return model(torch.tensor([tokens])).logits[0].float()


def new_sequence(llm: LLM, prompt: list[int]) -> Sequence:
    """A sequence for driving ``llm.engine.runner`` by hand (never handed to the scheduler)."""
    return Sequence(-1, prompt, SamplingParams(temperature=0.0), torch.Generator())


def check_rows(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {tuple(ours.shape)} vs reference {tuple(ref.shape)}"
    assert ours.dtype == torch.float32
    diff = max_abs_diff(ours, ref)
    assert diff <= LOGITS_ATOL, f"{what}: max |logits - transformers| = {diff:.3e} > {LOGITS_ATOL}"


def test_loaded_checkpoint_is_what_was_built(tiny_checkpoint, hf_model):
    llm = LLM(str(tiny_checkpoint.path), kv_cache_tokens=256)
    arch = llm.engine.loaded.arch
    cfg = hf_model.config
    assert arch.architecture == tiny_checkpoint.architecture
    assert arch.tie_word_embeddings == tiny_checkpoint.tied
    assert arch.num_kv_heads == cfg.num_key_value_heads and arch.num_kv_heads < arch.num_heads
    assert arch.head_dim == (getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    assert arch.qkv_bias == (tiny_checkpoint.architecture == "qwen2")
    assert arch.qk_norm == (tiny_checkpoint.architecture == "qwen3")
    if "llama3" in tiny_checkpoint.name:
        assert arch.rope_scaling is not None and arch.rope_scaling["rope_type"] == "llama3"
    model = llm.engine.loaded.model
    tied_in_specfork = model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert tied_in_specfork == tiny_checkpoint.tied
    # The randomization reached the tensors specfork loaded (not all-ones norms / zero biases).
    attn = model.layers[0].self_attn
    if arch.qk_norm:
        assert not torch.all(attn.q_norm.weight == 1) and not torch.all(attn.k_norm.weight == 1)
    if arch.qkv_bias:
        assert attn.qkv_proj.bias is not None and attn.qkv_proj.bias.abs().min() > 0


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_and_decode_logits_match(tiny_checkpoint, hf_model, block_size):
    llm = LLM(str(tiny_checkpoint.path), block_size=block_size, kv_cache_tokens=512)
    engine = llm.engine
    prompt = random_prompt(37, seed=7)  # 37 and 37 + 32 are not multiples of the block size
    seq = new_sequence(llm, prompt)
    engine.block_manager.grow(seq, len(seq))
    try:
        prefill = engine.runner.forward([seq], [0], [prompt], list(range(len(prompt))))
        seq.num_cached_tokens = len(prompt)
        steps = []
        last = prefill[-1]
        for _ in range(DECODE_STEPS):
            tok = int(last.argmax())
            seq.token_ids.append(tok)
            engine.block_manager.grow(seq, len(seq))
            last = engine.runner.forward([seq], [len(seq) - 1], [[tok]], [0])[0]
            seq.num_cached_tokens = len(seq)
            steps.append(last)
        assert len(seq.block_table) == -(-len(seq) // block_size)
    finally:
        engine.block_manager.free(seq)
    assert engine.block_manager.num_used_blocks == 0

    ref = hf_logits(hf_model, seq.token_ids)  # row p: logits after token p
    check_rows(prefill, ref[: len(prompt)], f"{tiny_checkpoint} prefill")
    for i, ours in enumerate(steps):
        check_rows(ours, ref[len(prompt) + i], f"{tiny_checkpoint} decode step {i}")


def test_batched_chunked_prefill_and_decode_logits_match(tiny_checkpoint, hf_model):
    """Sequences of different lengths share each forward pass (padded queries, per-sequence
    masks); one prompt is prefilled in two chunks, the second starting mid-block."""
    llm = LLM(str(tiny_checkpoint.path), block_size=4, kv_cache_tokens=1024)
    engine, runner = llm.engine, llm.engine.runner
    prompts = [random_prompt(n, seed=100 + n) for n in (13, 5, 22)]
    seqs = [new_sequence(llm, p) for p in prompts]
    computed: list[list[torch.Tensor]] = [[] for _ in seqs]  # logits rows, in position order

    def run(batch, starts, tokens):
        for s, st, toks in zip(batch, starts, tokens, strict=True):
            engine.block_manager.grow(s, st + len(toks))
        n = sum(len(t) for t in tokens)
        logits = runner.forward(batch, starts, tokens, list(range(n)))
        assert logits.shape[0] == n
        offset = 0
        for s, st, toks in zip(batch, starts, tokens, strict=True):
            computed[seqs.index(s)].extend(logits[offset : offset + len(toks)])
            s.num_cached_tokens = st + len(toks)
            offset += len(toks)

    try:
        a, b, c = seqs
        run([a, b, c], [0, 0, 0], [prompts[0], prompts[1], prompts[2][:10]])
        run([c], [10], [prompts[2][10:]])
        for _ in range(DECODE_STEPS):
            toks = []
            for s, rows in zip(seqs, computed, strict=True):
                s.token_ids.append(int(rows[-1].argmax()))
                toks.append([s.token_ids[-1]])
            run(seqs, [len(s) - 1 for s in seqs], toks)
    finally:
        for s in seqs:
            engine.block_manager.free(s)

    for s, rows in zip(seqs, computed, strict=True):
        assert len(rows) == len(s)
        ref = hf_logits(hf_model, s.token_ids)
        # The last row predicts a token that was never fed; compare all rows.
        check_rows(torch.stack(rows), ref, f"{tiny_checkpoint} batched, prompt of {s.num_prompt_tokens}")


GEN_LENGTHS = (1, 6, 13, 29, 47)
GEN_TOKENS = 32


@torch.inference_mode()
def hf_greedy(
    model, prompt: list[int], max_new_tokens: int, eos: list[int]
) -> tuple[list[int], list[torch.Tensor]]:
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        do_sample=False,
        max_new_tokens=max_new_tokens,
        eos_token_id=eos or None,
        pad_token_id=0,
        output_logits=True,
        return_dict_in_generate=True,
    )
    tokens = out.sequences[0, len(prompt) :].tolist()
    logits = [row[0].float() for row in out.logits]
    assert len(logits) == len(tokens)
    return tokens, logits


def test_greedy_generate_matches_transformers_and_is_batch_invariant(tiny_checkpoint, hf_model):
    prompts = [random_prompt(n, seed=200 + n) for n in GEN_LENGTHS]
    params = SamplingParams(temperature=0.0, max_tokens=GEN_TOKENS)
    # Small blocks and a small token budget: prompts are prefilled in chunks across blocks.
    llm = LLM(str(tiny_checkpoint.path), block_size=4, max_num_batched_tokens=24, kv_cache_tokens=2048)
    batched = llm.generate(prompts, params)
    assert llm.engine.block_manager.num_used_blocks == 0
    eos = sorted(llm.engine.eos_token_ids)

    alone_llm = LLM(str(tiny_checkpoint.path), block_size=8, kv_cache_tokens=512)
    alone = [alone_llm.generate([p], params)[0] for p in prompts]

    for p, out, single in zip(prompts, batched, alone, strict=True):
        assert out.prompt_token_ids == p
        assert out.token_ids == single.token_ids, (
            f"{tiny_checkpoint}: prompt of {len(p)} tokens generates differently in a batch\n"
            f"  batched: {out.token_ids}\n  alone:   {single.token_ids}"
        )
        assert 1 <= len(out.token_ids) <= GEN_TOKENS
        if out.finish_reason == "length":
            assert len(out.token_ids) == GEN_TOKENS
        else:
            assert out.finish_reason == "stop" and out.token_ids[-1] in eos
        ref_tokens, ref_logits = hf_greedy(hf_model, p, GEN_TOKENS, eos)
        label = f"{tiny_checkpoint}, prompt of {len(p)}"
        assert_greedy_match(out.token_ids, ref_tokens, ref_logits, label=label)


# ---- the comparator itself ------------------------------------------------------------------


def _logits(rows: list[dict[int, float]], vocab: int = 8) -> torch.Tensor:
    out = torch.zeros(len(rows), vocab)
    for i, row in enumerate(rows):
        for t, v in row.items():
            out[i, t] = v
    return out


def test_comparator_accepts_equal_and_near_tie():
    ref = _logits([{3: 5.0}, {4: 2.0, 5: 2.0 - 1e-5}, {1: 1.0}])
    assert assert_greedy_match([3, 4, 1], [3, 4, 1], ref) is None
    # Divergence at a near-tie is tolerated, and nothing after it is compared.
    assert assert_greedy_match([3, 5, 7, 7], [3, 4, 1], ref) == 1


def test_comparator_rejects_real_divergence():
    ref = _logits([{3: 5.0}, {4: 2.0, 5: 1.9}, {1: 1.0}])
    with pytest.raises(AssertionError, match="diverge at position 1"):
        assert_greedy_match([3, 5, 1], [3, 4, 1], ref)
    # Even a second-best token with a clear gap is a failure.
    with pytest.raises(AssertionError, match="diverge at position 0"):
        assert_greedy_match([0], [3], ref)


def test_comparator_rejects_length_mismatch_and_wrong_logits():
    ref = _logits([{3: 5.0}, {4: 2.0}, {1: 1.0}])
    with pytest.raises(AssertionError, match="different lengths"):
        assert_greedy_match([3, 4], [3, 4, 1], ref)
    with pytest.raises(AssertionError, match="different lengths"):
        assert_greedy_match([3, 4, 1, 2], [3, 4, 1], ref)
    with pytest.raises(AssertionError, match="not the argmax"):
        assert_greedy_match([3, 0], [3, 6], ref)


def test_gguf_rope_freq_factors_equal_llama3_scaling():
    """Llama-3.x GGUF files carry rope scaling as rope_freqs divisors; they must reproduce HF's
    llama3 inverse frequencies."""
    from specfork.layers.rotary import rope_inv_freq

    llama3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
              "original_max_position_embeddings": 64}
    base = rope_inv_freq(32, 10000.0, None)
    scaled = rope_inv_freq(32, 10000.0, llama3)
    factors = (base / scaled).tolist()
    torch.testing.assert_close(rope_inv_freq(32, 10000.0, {"rope_type": "freq_factors", "factors": factors}), scaled)

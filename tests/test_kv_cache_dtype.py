"""The float16 KV cache (the default for quantised models on the CPU; ``--kv-cache-dtype
float16``): keys and values are rounded to fp16 when written and read back exactly. On the embedded model its logits stay within the documented
tolerance of transformers' fp32 reference (docs/benchmarks.md), and greedy decoding agrees with
transformers except at near-ties. (Bit-identity of the native calls and the module path, and
deterministic SD = AR, with a float16 cache: tests/test_quantized.py.)"""

from __future__ import annotations

import pytest
import torch
from helpers import assert_greedy_match, humaneval_prompts, max_abs_diff, prefill_logits

from specfork import LLM, SamplingParams
from specfork.errors import SpecforkError

TOLERANCE = 2e-3  # of the largest reference logit; measured <= 1.35e-3 on 6 prompts (the float32 cache: 2.3e-4)


def test_float16_kv_cache_stays_within_its_tolerance_of_transformers(embedded_hf_model):
    hf_model = embedded_hf_model
    llm = LLM(kv_cache_dtype="float16")
    assert all(c.dtype == torch.float16 for c in llm.engine.runner.kv_caches)
    prompts = [llm.engine.encode_chat([{"role": "user", "content": "Explain what a hash table is."}]),
               llm.encode(humaneval_prompts(1)[0])]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    for prompt, out in zip(prompts, outputs, strict=True):
        with torch.inference_mode():
            ref = hf_model(torch.tensor([prompt + out.token_ids])).logits[0].float()
        scale = float(ref.abs().max())
        diff = max_abs_diff(prefill_logits(llm, prompt + out.token_ids), ref)
        assert diff <= TOLERANCE * scale, f"float16-cache logits differ by {diff:.3e} (scale {scale:.1f})"
        ref_tokens = ref[len(prompt) - 1 : -1].argmax(-1).tolist()  # teacher-forced on our tokens
        assert_greedy_match(out.token_ids, ref_tokens, ref[len(prompt) - 1 : -1], atol=2 * TOLERANCE * scale,
                            label="float16 KV cache")


def test_the_default_cache_is_float16_for_a_quantised_model_only(tiny_checkpoints):
    """The embedded GGUF's projections run the native quantised kernels: a float16 cache unless
    asked otherwise; an fp32 checkpoint keeps its own dtype."""
    assert all(c.dtype == torch.float16 for c in LLM().engine.runner.kv_caches)
    assert all(c.dtype == torch.float32 for c in LLM(kv_cache_dtype="float32").engine.runner.kv_caches)
    fp32_checkpoint = next(iter(tiny_checkpoints.values())).path
    assert all(c.dtype == torch.float32 for c in LLM(str(fp32_checkpoint)).engine.runner.kv_caches)


def test_a_bad_kv_cache_dtype_is_a_clear_error():
    with pytest.raises(SpecforkError, match="kv_cache_dtype must be one of float32, float16"):
        LLM(kv_cache_dtype="int8")

"""Feature capture for drafters that read the target's hidden states (EAGLE-3): the captured
features are the inputs of the chosen layers (as transformers' hidden_states), on the module
path and on the fused native decode path, and capturing changes no logit, bit for bit."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from specfork import LLM
from specfork.bench.forward import unfused
from specfork.engine.sequence import Sequence
from specfork.loading.eagle3 import default_feature_layers
from specfork.sampling_params import SamplingParams


def _passes(llm, ids: list[int], layers: tuple[int, ...]):
    """Logits and features of a prefill of ``ids[:-3]`` and then three one-token decode passes."""
    runner = llm.engine.runner
    runner.feature_layers, runner.features = (), None
    if layers:
        runner.capture_features(layers)
    seq = Sequence(-1, list(ids), SamplingParams(temperature=0.0), torch.Generator())
    llm.engine.block_manager.grow(seq, len(ids))
    logits, features = [], []
    try:
        n = len(ids) - 3
        logits.append(runner.forward([seq], [0], [ids[:n]], list(range(n)), decode=False))
        features.append(runner.features)
        for pos in range(n, len(ids)):
            logits.append(runner.forward([seq], [pos], [[ids[pos]]], [0], decode=True))
            features.append(runner.features)
    finally:
        llm.engine.block_manager.free(seq)
        runner.feature_layers, runner.features = (), None
    return logits, features


def test_features_are_the_layer_inputs_and_change_no_logit(tiny_checkpoints):
    path = tiny_checkpoints["llama-gqa-tied"].path
    llm = LLM(str(path))
    ids = [1, 5, 9, 33, 7, 100, 42, 3, 17, 250]
    layers = default_feature_layers(3)
    plain_logits, plain_features = _passes(llm, ids, ())
    logits, features = _passes(llm, ids, layers)
    assert all(f is None for f in plain_features)
    assert all(torch.equal(a, b) for a, b in zip(plain_logits, logits, strict=True))
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states  # [i]: input of layer i
    expected = torch.cat([hidden[i][0] for i in layers], dim=-1)
    got = torch.cat(features)
    assert got.shape == (len(ids), 3 * 64)
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)


def test_fused_decode_path_captures_the_same_features_bit_for_bit():
    llm = LLM("smollm2-135m", max_model_len=256, kv_cache_tokens=1024)
    runner = llm.engine.runner
    if not runner.native_attention_available or runner.model.layers[0].fused_decode is None:
        pytest.skip("the fused native decoder layer is not available on this machine")
    ids = llm.encode("def fibonacci(n):\n    ")
    layers = default_feature_layers(30)
    plain_logits, _ = _passes(llm, ids, ())
    logits, features = _passes(llm, ids, layers)
    assert all(torch.equal(a, b) for a, b in zip(plain_logits, logits, strict=True))
    # The decode passes ran the native stack; the same tokens through the module path agree.
    assert runner.model.fused_stack is not None  # decode passes: all layers in one native call
    with unfused(runner.model):
        module_logits, module_features = _passes(llm, ids, layers)
    assert all(torch.equal(a, b) for a, b in zip(module_features[1:], features[1:], strict=True))
    assert all(torch.equal(a, b) for a, b in zip(module_logits, logits, strict=True))

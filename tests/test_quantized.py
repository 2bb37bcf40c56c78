"""Native quantised execution: GGUF's Q4_0 / Q4_1 / Q8_0 / Q5_0 / Q5_1 and k-quant (Q4_K, Q5_K,
Q6_K) weights run without dequantising per step.

References are the ``gguf`` package's own quantiser and dequantiser: unpacked blocks dequantise as
it does (exactly, or for the k-quants within the fp16 rounding of their combined scales), and the
native layer must equal dequantise-then-float32-matmul within the error its activation rounding
allows (each input rounded to int16 per row and quantisation group, see ``csrc/quant_gemm.cpp``)
plus float rounding, for every shape, and compute each row independently of the others (so
speculative verification reproduces decoding exactly).
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, quants
from helpers import assert_greedy_match, prefill_logits
from random_blocks import k_quant_llama_gguf, random_blocks

from specfork import LLM, SamplingParams
from specfork.layers.attention import read_kv
from specfork.layers.gguf_blocks import BLOCK_BYTES, NATIVE_FORMATS, decode_blocks, from_gguf_blocks
from specfork.layers.linear import DenseLinear, make_linear
from specfork.layers.quantized import IQ4, Q8, QuantizedLinear, QuantizedWeight, quantize_int4
from specfork.loading.gguf_export import export_gguf
from specfork.native_kernels import kernels as native_kernels

needs_kernel = pytest.mark.skipif(native_kernels() is None, reason="native kernels need a C++ compiler")

SHAPES = [(576, 576), (100, 64), (33, 96), (1, 32), (1536, 576)]  # N not a multiple of the 32-column tile too


def _activation_rounding_bound(weight: QuantizedWeight, x: torch.Tensor) -> torch.Tensor:
    """[M, N] bound on |native - exact| from rounding the inputs: each input of a row and group is
    rounded to a multiple of s = max|x_group| / 32767 (error <= s / 2) and multiplies the centred
    integer weight d * (q - c), c = 8 for Q4, 16 for Q5, 32 for Q6 and 0 for Q8 (the offset term uses the
    exact inputs)."""
    m, (n, k), g = x.shape[0], weight.shape, weight.group
    s = x.double().view(m, k // g, g).abs().amax(-1) / 32767
    centre = {4: 8, 5: 16, 6: 32, 8: 0}[weight.bits]
    centred = (weight.q.double() - centre).abs().view(n, k // g, g).sum(-1) * weight.scale.double().abs()
    return (s / 2) @ centred.t()


K_QUANTS = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K")
I_QUANTS = ("IQ4_NL", "IQ4_XS")
ROUNDED = (*K_QUANTS, "IQ4_XS")  # a combined scale (super-block d x sub-block scale) rounded to fp16
K_SHAPES = [(576, 1536), (100, 256), (33, 512), (1, 256)]  # k-quant rows hold whole super-blocks of 256


def _gguf_weight(type_name: str, n: int, k: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(the blocks [n, row bytes], gguf's own dequantisation of them as float32 [n, k]): quantised by
    gguf where it can, random well-formed blocks for the k-quants and IQ4 (gguf only dequantises those)."""
    qtype = getattr(GGMLQuantizationType, type_name)
    if type_name in K_QUANTS + I_QUANTS:
        raw = random_blocks(type_name, n, k, seed=seed)
    else:
        rng = np.random.default_rng(seed)
        raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32) * 0.05, qtype)
    reference = torch.from_numpy(quants.dequantize(raw, qtype).reshape(n, k).astype(np.float32))
    return raw, reference


def _cases(types):
    return [(t, shape) for t in types for shape in (K_SHAPES if t in ROUNDED else SHAPES)]


@pytest.mark.parametrize("type_name, shape", _cases(NATIVE_FORMATS), ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_unpacked_blocks_dequantize_as_gguf(type_name, shape):
    """Every format's integers, scales and offsets (float32, before the kernel's fp16 storage) give
    gguf's own values bit for bit; stored as fp16 they stay exact for all but the k-quants, whose
    combined scales d_super * sc (and minima dmin * m) move by at most 2^-11 of a weight's terms, as
    do IQ4_XS's (IQ4's 4-bit indices become the 8-bit values they select)."""
    raw, reference = _gguf_weight(type_name, *shape, seed=shape[0])
    q, d, o, bits = decode_blocks(raw, type_name, shape)
    exact = QuantizedWeight(torch.from_numpy(q), torch.from_numpy(d), torch.from_numpy(o), bits, "exact")
    g = exact.group
    terms = np.abs(q.astype(np.float64)) * np.repeat(np.abs(d), g, axis=1) + np.repeat(np.abs(o), g, axis=1)
    if type_name == "Q6_K":  # q d + o (q up to 63, d an fp16 times an int8) may round where gguf's d (q - 32) does not
        assert ((exact.dequantize().double() - reference.double()).abs().numpy() <= 2.0**-23 * terms).all()
    else:
        assert torch.equal(exact.dequantize(), reference)
    weight = from_gguf_blocks(raw, type_name, shape)
    assert weight.bits == bits and weight.group == (16 if type_name in ("Q2_K", "Q3_K", "Q6_K") else 32)
    if type_name not in ROUNDED:
        assert torch.equal(weight.dequantize(), reference)
        return
    moved = (weight.dequantize().double() - reference.double()).abs().numpy()
    assert (moved <= (2.0**-11 + 2.0**-22) * terms + 1e-12).all()  # fp16 rounding, plus float32's of w
    assert moved.max() > 0  # the rounding is real here: the bound above is what tests it


def test_formats_without_a_native_form_are_refused_by_the_unpacker():
    with pytest.raises(ValueError, match="no native form for GGUF IQ3_S"):
        decode_blocks(np.zeros((1, 110), np.uint8), "IQ3_S", (1, 256))
    with pytest.raises(ValueError, match="not a multiple of its block of 256"):
        decode_blocks(np.zeros((1, 144), np.uint8), "Q4_K", (1, 128))


def test_a_k_quant_scale_beyond_fp16_leaves_the_tensor_to_be_dequantised():
    raw = random_blocks("Q4_K", 2, 256)
    raw[0, 0:2] = np.array([60000.0], np.float16).view(np.uint8)  # d_super: times a sub-scale up to 63, past fp16
    raw[0, 4] = 63  # sub-block 0's scale
    assert from_gguf_blocks(raw, "Q4_K", (2, 256)) is None
    raw[0, 0:2] = np.array([1e-3], np.float16).view(np.uint8)
    assert from_gguf_blocks(raw, "Q4_K", (2, 256)) is not None


@needs_kernel
@pytest.mark.parametrize("type_name, shape", _cases(NATIVE_FORMATS), ids=lambda v: v if isinstance(v, str) else "x".join(map(str, v)))
def test_native_matmul_equals_dequantized_matmul(type_name, shape):
    raw, _ = _gguf_weight(type_name, *shape, seed=shape[0])
    # Inputs of their own seed: the tolerance below is for typical rows, and a row whose terms
    # cancel may exceed it (the bound above is the guarantee), so the inputs must not depend on
    # what ran before.
    gen = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    bias = torch.randn(shape[0], generator=gen)
    weight = from_gguf_blocks(raw, type_name, shape)
    layer = make_linear(weight, bias)
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(11, shape[1], generator=gen)
    x[3] *= 1000.0  # the error scales with each row's own inputs
    # what the layer holds (gguf's values, exactly or within the test above's fp16 rounding)
    expected = x.double() @ weight.dequantize().double().t() + bias.double()
    got = layer(x)
    error = (got.double() - expected).abs()
    float_rounding = 1e-5 * (expected.abs().amax(-1, keepdim=True) + 1.0)
    assert bool((error <= _activation_rounding_bound(weight, x) + float_rounding).all())
    # typical rows (Q2_K / Q3_K's values, 0..3 / 0..7, sit off the 4-bit kernel's centre 8: more rounding)
    typical = 1e-3 if type_name in ("Q2_K", "Q3_K") else 2e-4
    assert float((error / (expected.abs().amax(-1, keepdim=True) + 1.0)).max()) <= typical
    # each row as if alone: bit-identical (batch invariance)
    for m in (1, 2, 3, 6, 9):
        assert torch.equal(layer(x[:m]), got[:m])
    assert torch.equal(torch.cat([layer(x[i : i + 1]) for i in range(11)]), got)


def test_f16_weights_run_dense_and_exact():
    rng = np.random.default_rng(1)
    w16 = rng.standard_normal((70, 64)).astype(np.float16)
    layer = make_linear(torch.from_numpy(w16.astype(np.float32)))
    assert isinstance(layer, DenseLinear)  # f16 -> f32 is exact; the dense kernel runs it
    x = torch.randn(3, 64)
    assert torch.allclose(layer(x), x @ torch.from_numpy(w16.astype(np.float32)).t(), atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_quantization_at_load_runs_the_same_kernel(group):
    w = torch.randn(96, 256)
    q = quantize_int4(w, group)
    assert q.group == group and q.q.max() <= 15
    # scales and minima are fp16 values, as GGUF's Q4_1 stores them and the kernel reads them
    assert torch.equal(q.scale, q.scale.half().float()) and torch.equal(q.offset, q.offset.half().float())
    assert float((q.dequantize() - w).abs().max()) <= float((w.amax() - w.amin())) / 15  # within one step
    layer = make_linear(q)
    x = torch.randn(4, 256)
    error = (layer(x).double() - x.double() @ q.dequantize().double().t()).abs()
    assert bool((error <= _activation_rounding_bound(q, x) + 1e-5).all())


@needs_kernel
@pytest.mark.parametrize("type_name", ["Q4_0", "Q4_1", "Q8_0"])
def test_a_pass_over_the_weight_reads_the_bytes_gguf_stores(type_name):
    """The packed weight keeps GGUF's fp16 scales (and Q4_1's fp16 minima; Q4_0 and Q8_0 need no
    offsets once centred), so a decode step streams 18 / 20 / 34 bytes per 32 weights, as the file."""
    n, k = 576, 1536
    raw, _ = _gguf_weight(type_name, n, k)
    layer = make_linear(from_gguf_blocks(raw, type_name, (n, k)))
    assert layer.weight_bytes == n * k // 32 * BLOCK_BYTES[type_name]


@needs_kernel
@pytest.mark.parametrize("type_name, bits_per_weight", [("Q5_0", 5.5), ("Q5_1", 6.0), ("Q4_K", 5.0), ("Q5_K", 6.0),
                                                        ("Q6_K", 7.0), ("Q3_K", 6.0), ("Q2_K", 6.0),
                                                        ("IQ4_NL", 4.5), ("IQ4_XS", 4.5)])
def test_every_format_is_streamed_at_its_packed_width(type_name, bits_per_weight):
    """5- and 6-bit values take 5 and 6 bits (nibbles plus planes of higher bits), 2- and 3-bit ones
    4, plus fp16 scales (and offsets where o + c d is not zero) per group: Q5_0 and Q5_1 as many
    bytes as the file, k-quants more (their fp16 scales per 32 or 16 values where GGUF has 4- to
    8-bit ones; Q2_K and Q3_K more than twice their 2.6 and 3.4 bits), IQ4's values as their 4-bit
    indices (IQ4_NL as many bytes as the file, IQ4_XS fp16 scales where it has 6-bit ones)."""
    n, k = 64, 512
    layer = make_linear(from_gguf_blocks(_gguf_weight(type_name, n, k)[0], type_name, (n, k)))
    assert isinstance(layer, QuantizedLinear)
    assert layer.weight_bytes == n * k * bits_per_weight / 8


@needs_kernel
def test_the_kernel_refuses_values_and_groups_beyond_a_format():
    kernels = native_kernels()
    q = torch.full((32, 64), 40, dtype=torch.uint8)  # a 6-bit value in a 5-bit weight
    with pytest.raises(RuntimeError, match="Q5 values must be 0..31"):
        kernels.pack_quantized(q, torch.ones(32, 2), torch.zeros(32, 2), 5)
    with pytest.raises(RuntimeError, match="IQ4 indices must be 0..15"):  # an index past IQ4's 16 values
        kernels.pack_quantized(torch.full((32, 64), 16, dtype=torch.uint8), torch.ones(32, 2), torch.zeros(32, 2), IQ4)
    packed = kernels.pack_quantized(torch.zeros(32, 128, dtype=torch.uint8), torch.ones(32, 2), torch.zeros(32, 2), 6)
    with pytest.raises(RuntimeError, match="groups of 64 inputs are not supported"):  # 6-bit sums allow 32
        kernels.quant_linear(torch.zeros(1, 128), *packed, 32, 6, None)
    # the layer does not ask for it: such a weight runs dense
    wide = QuantizedWeight(torch.zeros(32, 128, dtype=torch.uint8), torch.ones(32, 2), torch.zeros(32, 2), 6, "test")
    assert isinstance(make_linear(wide), DenseLinear)


@needs_kernel
def test_packing_refuses_scales_that_are_not_fp16_values():
    q = torch.zeros(32, 64, dtype=torch.uint8)
    with pytest.raises(RuntimeError, match="fp16 values"):
        native_kernels().pack_quantized(q, torch.full((32, 2), 0.1), torch.zeros(32, 2), 4)  # 0.1: no fp16 value
    with pytest.raises(RuntimeError, match="fp16 values"):
        native_kernels().pack_quantized(q, torch.full((32, 2), 0.125), torch.full((32, 2), 1e-9), 4)


@needs_kernel
def test_the_gemm_benchmark_script_runs(monkeypatch, capsys):
    """benchmarks/bench_quant_gemm.py end to end on every instruction set this CPU has (a smoke test
    of the script, not a measurement: it once stopped at its first shape, unnoticed, when the packer
    began to refuse scales that are not fp16 values)."""
    import runpy
    import sys
    from pathlib import Path

    script = Path(__file__).resolve().parent.parent / "benchmarks" / "bench_quant_gemm.py"
    isas = native_kernels().supported_isas()
    monkeypatch.setattr(sys, "argv", [str(script), "--isas", ",".join(isas), "--rows", "1,3", "--repeat", "1"])
    runpy.run_path(str(script), run_name="__main__")
    rows = [line.split()[:2] for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows == [[isa, inputs] for isa in isas for inputs in ("int16", "int8")]


def test_shapes_the_kernel_cannot_take_are_refused_or_run_dense():
    with pytest.raises(ValueError, match="groups of 32"):
        quantize_int4(torch.randn(8, 48), 32)
    odd = QuantizedWeight(torch.zeros(8, 300, dtype=torch.uint8), torch.ones(8, 1), torch.zeros(8, 1), 4, "int4")
    layer = make_linear(odd)  # one group of 300 inputs: beyond the native kernel, so dense and correct
    assert isinstance(layer, DenseLinear)
    assert torch.allclose(layer(torch.ones(1, 300)), torch.zeros(1, 8))


def test_concatenation_keeps_weights_quantized():
    raw, _ = _gguf_weight("Q4_1", 64, 64)
    a = from_gguf_blocks(raw, "Q4_1", (64, 64))
    fused = torch.cat([a, a, a])
    assert isinstance(fused, QuantizedWeight) and fused.shape == (192, 64)
    assert torch.equal(fused.dequantize(), torch.cat([a.dequantize()] * 3))


@needs_kernel
def test_concatenating_different_formats_keeps_them_quantized_and_exact():
    """A fused projection of a Q4_K query and key and a Q6_K value (a Q4_K_M file's layer) is one
    6-bit weight in groups of 16, holding every part's weights exactly, and runs native; with a
    Q8_0 part, one 8-bit weight."""
    parts = [from_gguf_blocks(_gguf_weight(t, n, 256, seed=n)[0], t, (n, 256))
             for t, n in (("Q4_K", 64), ("Q4_K", 32), ("Q6_K", 32))]
    q8 = from_gguf_blocks(_gguf_weight("Q8_0", 32, 256)[0], "Q8_0", (32, 256))
    with_q8 = torch.cat([parts[0], q8, parts[2]])
    assert (with_q8.bits, with_q8.group, with_q8.q.dtype) == (8, 16, torch.int8)
    assert torch.equal(with_q8.dequantize(), torch.cat([parts[0].dequantize(), q8.dequantize(), parts[2].dequantize()]))
    x8 = torch.randn(2, 256)
    exact8 = x8.double() @ with_q8.dequantize().double().t()
    assert bool(((make_linear(with_q8)(x8).double() - exact8).abs() <= _activation_rounding_bound(with_q8, x8) + 1e-5).all())
    fused = torch.cat(parts)
    assert isinstance(fused, QuantizedWeight) and (fused.bits, fused.group, fused.shape) == (6, 16, (128, 256))
    assert torch.equal(fused.dequantize(), torch.cat([p.dequantize() for p in parts]))
    layer = make_linear(fused)
    assert isinstance(layer, QuantizedLinear)
    x = torch.randn(3, 256)
    separate = torch.cat([make_linear(p)(x) for p in parts], dim=1)
    bound = torch.cat([_activation_rounding_bound(p, x) for p in parts], dim=1)
    assert bool(((layer(x) - separate).abs() <= 2 * bound + 1e-5).all())
    # activations rounded differently: no common form, so dense (and still exact)
    odd = torch.cat([parts[0], replace(parts[1], input_bits=8)])
    assert isinstance(odd, torch.Tensor) and torch.equal(odd, torch.cat([parts[0].dequantize(), parts[1].dequantize()]))


# ---- whole models -----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def quantized_ggufs(tiny_checkpoints, tmp_path_factory):
    root = tmp_path_factory.mktemp("qgguf")
    source = tiny_checkpoints["llama-gqa-tied"].path
    files = {t: export_gguf(source, root / f"tiny-{t}.gguf", vocab_from=None, out_type=t) for t in ("q4_0", "q4_1", "q8_0")}
    files["k-mix"] = k_quant_llama_gguf(root / "tiny-k-mix.gguf", K_MIX)
    files["iq4-mix"] = k_quant_llama_gguf(root / "tiny-iq4-mix.gguf", IQ4_MIX)
    return files


# The formats of a tiny model whose every matrix is in another block format: a Q4_K_M file's Q4_K
# query, key and gate beside Q6_K values and embeddings, plus Q5_K, Q5_1 and Q5_0.
K_MIX = {"token_embd": "Q6_K", "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_K",
         "ffn_gate": "Q4_K", "ffn_up": "Q5_1", "ffn_down": "Q5_0"}
# IQ4_XS and IQ4_NL matrices (an IQ4_XS file holds IQ4_NL where a row cannot hold whole super-blocks),
# fused together (q/k/v), and a Q4_K up projection beside an IQ4_XS gate (its 4-bit q lifted to the
# 8-bit form of IQ4's values, which then stays 8-bit).
IQ4_MIX = {"token_embd": "IQ4_XS", "attn_q": "IQ4_XS", "attn_k": "IQ4_XS", "attn_v": "IQ4_NL", "attn_output": "IQ4_NL",
           "ffn_gate": "IQ4_XS", "ffn_up": "Q4_K", "ffn_down": "IQ4_NL"}


@needs_kernel
@pytest.mark.parametrize("model, sources", [("k-mix", {"q4_k+q6_k", "q5_k", "q4_k+q5_1", "q5_0", "q6_k"}),
                                            ("iq4-mix", {"iq4_nl+iq4_xs", "iq4_nl", "iq4_xs+q4_k", "iq4_xs"})])
def test_a_model_of_k_quants_and_five_bit_blocks_runs_native_and_close_to_gguf(quantized_ggufs, model, sources):
    """Every projection stays quantised (fused ones of mixed formats too), the logits stay within
    the fp16 rounding of the k-quants' and IQ4_XS's scales of the exactly dequantised model's, and
    greedy decoding agrees except at near-ties."""
    path = str(quantized_ggufs[model])
    native, fp32 = LLM(path, weights="native", kv_cache_dtype="float32"), LLM(path, weights="fp32")
    linears = {name: type(m).__name__ for name, m in native.engine.loaded.model.named_modules()
               if type(m).__name__ in ("QuantizedLinear", "DenseLinear")}
    assert len(linears) == 9 and set(linears.values()) == {"QuantizedLinear"}, linears
    layers = [m for m in native.engine.loaded.model.modules() if isinstance(m, QuantizedLinear)]
    assert {m.source for m in layers} == sources
    for m in layers:  # IQ4's values, fused or not, packed as their 4-bit indices; beside other formats, 8-bit
        iq4_only = set(m.source.split("+")) <= {"iq4_nl", "iq4_xs"}
        assert (m.format == IQ4) == iq4_only and (m.format == Q8) == ("iq4" in m.source and not iq4_only), m
    _assert_close_to_dequantized(native, fp32, 5e-3, atol=2e-2)


def _assert_close_to_dequantized(native: LLM, fp32: LLM, tolerance: float, **near_ties) -> None:
    """A prompt's logits within ``tolerance`` of the largest (+ 1), and greedy decoding the same
    except at near-ties (``near_ties``: assert_greedy_match's tolerances)."""
    ids = [1, 17, 33, 5, 99, 201, 4, 8]
    a, b = prefill_logits(native, ids), prefill_logits(fp32, ids)
    assert float((a - b).abs().max()) <= tolerance * (float(b.abs().max()) + 1)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    ours = native.generate([ids], params)[0].token_ids
    theirs = fp32.generate([ids], params)[0].token_ids
    assert_greedy_match(ours, theirs, prefill_logits(fp32, ids + theirs)[len(ids) - 1 :], **near_ties)


@needs_kernel
@pytest.mark.parametrize("out_type", ["q4_0", "q4_1", "q8_0"])
def test_native_model_logits_match_the_dequantized_model(quantized_ggufs, out_type):
    path = str(quantized_ggufs[out_type])
    # the kernel's own error: both with a float32 KV cache (a quantised model's default is float16,
    # whose tolerance test_kv_cache_dtype.py checks against transformers)
    native, fp32 = LLM(path, weights="native", kv_cache_dtype="float32"), LLM(path, weights="fp32")
    kinds = {type(m).__name__ for m in native.engine.loaded.model.modules()}
    assert "QuantizedLinear" in kinds
    assert "QuantizedLinear" not in {type(m).__name__ for m in fp32.engine.loaded.model.modules()}
    _assert_close_to_dequantized(native, fp32, 1e-4)


@needs_kernel
@pytest.mark.parametrize("mode, kv, weights, target", [("sd", None, "native", "q4_1"), ("ssd", None, "native", "q4_1"),
                                                      ("sd", "float32", "native", "q4_1"),
                                                      ("sd", None, "native-int8", "q4_1"),
                                                      ("ssd", None, "native-int8", "q4_1"),
                                                      ("sd", None, "native", "k-mix"),
                                                      ("sd", None, "native", "iq4-mix")])
def test_speculation_on_the_native_path_equals_native_ar(quantized_ggufs, mode, kv, weights, target):
    path = str(quantized_ggufs[target])
    prompts = [[1, 17, 33, 5], [1, 2, 3, 4, 5, 6, 7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    ar = [o.token_ids for o in LLM(path, deterministic=True, kv_cache_dtype=kv, weights=weights).generate(prompts, params)]
    with LLM(path, mode=mode, draft=str(quantized_ggufs["q8_0"]), k=3, deterministic=True, kv_cache_dtype=kv,
             weights=weights) as spec:
        assert [o.token_ids for o in spec.generate(prompts, params)] == ar


@needs_kernel
@pytest.mark.parametrize("max_tokens", [24, pytest.param(96, marks=pytest.mark.slow)])
def test_embedded_model_native_greedy_equals_fp32_except_near_ties(max_tokens):
    native, fp32 = LLM(weights="native"), LLM(weights="fp32")
    prompts = ["def fibonacci(n):", "The capital of France is", "Write a haiku about the sea."]
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for prompt in prompts:
        ours = native.generate(prompt, params)[0].token_ids
        theirs = fp32.generate(prompt, params)[0].token_ids
        ids = fp32.encode(prompt)
        logits = prefill_logits(fp32, ids + theirs)[len(ids) - 1 :]
        assert_greedy_match(ours, theirs, logits, atol=2e-2, rtol=2e-3, label=prompt)


# ---- the fused decoder layer ---------------------------------------------------------------------


@needs_kernel
@pytest.mark.parametrize("out_type, kv, weights", [("q4_0", None, "native"), ("q4_1", None, "native"),
                                                   ("q8_0", None, "native"), ("q4_1", "float32", "native"),
                                                   ("q4_1", None, "native-int8"), ("q8_0", None, "native-int8"),
                                                   ("k-mix", None, "native"), ("k-mix", None, "native-int8"),
                                                   ("iq4-mix", None, "native"), ("iq4-mix", None, "native-int8")])
def test_one_native_call_per_forward_is_bit_identical_to_the_module_path(quantized_ggufs, out_type, kv, weights):
    """Decode and verify windows of two sequences: all layers and the LM head in one native call,
    one native call per layer, and the Python module path give the same logits, features and KV
    cache, bit for bit (with the default float16 or a float32 KV cache, int16 or int8 activations)."""
    from specfork.bench.forward import unfused
    from specfork.engine.sequence import Sequence
    from specfork.layers.quantized import QuantizedLinear

    llm = LLM(str(quantized_ggufs[out_type]), kv_cache_dtype=kv, weights=weights)
    # a quantised model's cache is float16 unless asked otherwise
    assert llm.engine.runner.kv_caches[0].dtype == (torch.float32 if kv == "float32" else torch.float16)
    engine, model = llm.engine, llm.engine.loaded.model
    assert model.fused_stack is not None and all(layer.fused_decode is not None for layer in model.layers)
    assert {m.input_bits for m in model.modules() if isinstance(m, QuantizedLinear)} == {8 if weights != "native" else 16}
    prompts = [[1, 17, 33, 5, 99, 201, 4, 8, 3, 3, 7], [2, 9, 40]]
    seqs = [Sequence(-1 - i, p + [5, 6, 7], SamplingParams(temperature=0.0), torch.Generator())
            for i, p in enumerate(prompts)]
    for seq, prompt in zip(seqs, prompts, strict=True):
        engine.block_manager.grow(seq, len(prompt) + 3)
        engine.runner.forward([seq], [0], [prompt], [len(prompt) - 1], decode=False)
    calls = []  # per call of the one-call stack: did its LM head run inside it
    stack = model.fused_stack

    def counted(*args):
        out = stack(*args)
        calls.append(out[2].numel() > 0)
        return out

    model.fused_stack = counted
    engine.runner.capture_features((0, 1, 1))

    def run(args):
        logits = engine.runner.forward(*args)
        return logits, engine.runner.features, [c.clone() for c in engine.runner.kv_caches]

    try:
        for rows in ([1, 1], [3, 2], [1, 3]):  # decode and verification windows, two sequences
            args = ([s for s in seqs], [len(p) for p in prompts], [[5, 6, 7][:n] for n in rows], list(range(sum(rows))))
            one_call = run(args)
            assert calls and all(calls), "the one-call stack did not run, or not with its LM head"
            calls.clear()
            model.fused_stack, saved = None, model.fused_stack
            per_layer = run(args)
            model.fused_stack = saved
            with unfused(model):
                modules = run(args)
            assert not calls
            for other in (per_layer, modules):
                assert torch.equal(one_call[0], other[0]) and torch.equal(one_call[1], other[1])
                assert all(torch.equal(a, b) for a, b in zip(one_call[2], other[2], strict=True))
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


@needs_kernel
def test_the_prepared_stack_reads_weights_whose_storage_was_replaced(quantized_ggufs):
    """The one-call stack parses its weights once. A weight whose storage is replaced afterwards
    (loading moves the packed weights onto 2 MB pages that way, after the model is built) must be
    read where it now lives: here a layer's down projection gets new values in new storage while
    the old storage stays alive, so reading the old pointers would give the old logits."""
    from specfork.bench.forward import unfused
    from specfork.engine.sequence import Sequence

    llm = LLM(str(quantized_ggufs["q4_1"]))
    engine, model = llm.engine, llm.engine.loaded.model
    prompt = [1, 17, 33, 5, 99, 201, 4, 8, 3, 3, 7]
    seq = Sequence(-1, prompt + [5], SamplingParams(temperature=0.0), torch.Generator())
    engine.block_manager.grow(seq, len(prompt) + 1)

    def decode() -> torch.Tensor:
        engine.runner.forward([seq], [0], [prompt], [len(prompt) - 1], decode=False)
        return engine.runner.forward([seq], [len(prompt)], [[5]], [0])

    stack, calls = model.fused_stack, []
    assert stack is not None

    def counted(*args):
        calls.append(1)
        return stack(*args)

    model.fused_stack = counted
    try:
        before = decode()
        assert calls, "the decode did not run through the one-call stack"
        down = model.layers[1].mlp.down_proj
        old = down.values.data  # kept alive: its pointer stays valid, so only a stale read would find it
        down.values.data = torch.flip(old, dims=[0]).contiguous()  # other values, new storage
        calls.clear()
        one_call = decode()
        assert calls
        with unfused(model):
            modules = decode()
        assert torch.equal(one_call, modules) and not torch.equal(one_call, before)
    finally:
        model.fused_stack = stack
        engine.block_manager.free(seq)


@needs_kernel
def test_a_prompt_prefilled_in_one_pass_equals_the_prompt_fed_token_by_token(quantized_ggufs):
    """Prefill takes the native path (the batch-invariant attention kernel, one native call), so
    a prompt's logits and KV cache are the same, bit for bit, whether it is prefilled in one pass,
    fed one token at a time, or prefilled beside another prompt; a pass whose per-chunk partial
    results would pass the bound runs the kernel in slices of its rows, again bit for bit."""
    import specfork.engine.model_runner as model_runner
    from specfork.engine.sequence import Sequence

    llm = LLM(str(quantized_ggufs["q4_1"]), block_size=4)
    engine, runner = llm.engine, llm.engine.runner
    prompt, other = [1, 17, 33, 5, 99, 201, 4, 8, 3, 3, 7, 60, 2], [2, 9, 40, 41]
    seqs = [Sequence(-1 - i, list(p), SamplingParams(temperature=0.0), torch.Generator())
            for i, p in enumerate((prompt, prompt, prompt, other, prompt))]
    n = len(prompt)
    for seq in seqs:
        engine.block_manager.grow(seq, len(seq.token_ids))

    def cached(seq):  # the sequence's keys and values, every layer, in position order
        table = torch.tensor(seq.block_table)
        return [torch.stack(read_kv(c, table))[:, :n] for c in runner.kv_caches]

    try:
        meta = runner.prepare([seqs[0]], [0], [prompt])[2]
        assert meta.native_attention and meta.one_call and meta.native_slices is None
        whole = runner.forward([seqs[0]], [0], [prompt], list(range(n)), decode=False)
        stepped = [runner.forward([seqs[1]], [i], [[t]], [0], decode=i > 0) for i, t in enumerate(prompt)]
        beside = runner.forward([seqs[2], seqs[3]], [0, 0], [prompt, other], list(range(n)), decode=False)
        assert torch.equal(whole, torch.cat(stepped)) and torch.equal(whole, beside)
        bound = model_runner.NATIVE_PARTIAL_BYTES
        cfg = runner.model.config
        model_runner.NATIVE_PARTIAL_BYTES = 3 * cfg.num_heads * (cfg.head_dim + 2) * 4  # 3 queries' partials a call
        try:
            meta = runner.prepare([seqs[4]], [0], [prompt])[2]
            assert meta.native_attention and not meta.one_call and len(meta.native_slices) > 2
            sliced = runner.forward([seqs[4]], [0], [prompt], list(range(n)), decode=False)
        finally:
            model_runner.NATIVE_PARTIAL_BYTES = bound
        assert torch.equal(whole, sliced)
        for other_seq in (seqs[1], seqs[4]):
            for a, b in zip(cached(seqs[0]), cached(other_seq), strict=True):
                assert torch.equal(a, b)
    finally:
        for seq in seqs:
            engine.block_manager.free(seq)


@needs_kernel
def test_embedded_model_decodes_the_same_with_and_without_the_fused_layer():
    llm = LLM()
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    fused = llm.generate("def quicksort(items):", params)[0].token_ids
    from specfork.bench.forward import unfused

    with unfused(llm.engine.loaded.model):
        assert llm.generate("def quicksort(items):", params)[0].token_ids == fused

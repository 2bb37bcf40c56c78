"""The native kernels' instruction sets: the quantised GEMM compiled for portable C++, AVX2,
AVX-512 and AVX-512 VNNI gives identical results on every set this CPU runs, for Q4_0, Q4_1, Q8_0,
Q5_0, Q5_1, Q5_K, Q4_K, Q6_K, Q3_K, IQ4_NL, IQ4_XS and int4 weights, int16 and int8 activations, at every verify-window height
M = 1..9 and for a batch of 25 rows (several row blocks share each tile's weights, unpacked once
on AVX-512); the set in use is the best one."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_quantized import _gguf_weight

from specfork.layers.gguf_blocks import from_gguf_blocks
from specfork.layers.linear import make_linear
from specfork.layers.quantized import IQ4, QuantizedLinear, quantize_int4
from specfork.native_kernels import kernels as native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need a C++ compiler")

ORDER = ["portable", "avx2", "avx512", "avx512-vnni"]
SHAPES = [(576, 576), (100, 64), (33, 96)]  # N past the 32-column tiles too; K of odd pair counts per group below


def test_the_best_set_the_cpu_runs_is_the_one_in_use():
    k = native_kernels()
    supported = k.supported_isas()
    assert supported[0] == "portable" and supported == [s for s in ORDER if s in supported]
    assert k.kernel_isa() == supported[-1]
    import platform

    if platform.machine() == "x86_64":
        assert "avx2" in supported  # every machine this runs on (the build uses -march=native)
    from specfork.bench.machine import machine_info

    assert machine_info()["kernels"] == k.kernel_isa()  # what specfork bench prints
    unsupported = [s for s in ORDER if s not in supported]
    layer = make_linear(from_gguf_blocks(_gguf_weight("Q4_0", 32, 64)[0], "Q4_0", (32, 64)), None)
    for name in unsupported + ["sse9"]:
        with pytest.raises(RuntimeError, match="does not run|unknown instruction set"):
            _run(layer, torch.zeros(1, 64), name)


def _run(layer: QuantizedLinear, x: torch.Tensor, isa: str) -> torch.Tensor:
    return native_kernels().quant_linear_isa(x, layer.values, layer.scales, layer.offsets, layer.out_features,
                                             layer.format, layer.bias, isa)


def _weights():
    for type_name in ("Q4_0", "Q4_1", "Q8_0"):
        for n, k in SHAPES:
            yield f"{type_name}-{n}x{k}", from_gguf_blocks(_gguf_weight(type_name, n, k, seed=n)[0], type_name, (n, k))
    # 5- and 6-bit q, k-quants' groups of 16, IQ4's indices looked up in its table
    for type_name in ("Q5_0", "Q5_1", "Q5_K", "Q4_K", "Q6_K", "Q3_K", "IQ4_NL", "IQ4_XS"):
        for n, k in ((100, 256), (33, 512)):
            yield f"{type_name}-{n}x{k}", from_gguf_blocks(_gguf_weight(type_name, n, k, seed=n)[0], type_name, (n, k))
    gen = torch.Generator().manual_seed(7)
    for group in (32, 6):  # 6 inputs per group: an odd number of pairs, and no whole quads (int8 inputs: int16 kept)
        yield f"int4-g{group}", quantize_int4(torch.randn(70, 96, generator=gen), group)


@pytest.mark.parametrize("input_bits", [16, 8])
@pytest.mark.parametrize("name, weight", list(_weights()), ids=lambda v: v if isinstance(v, str) else "")
def test_every_instruction_set_gives_identical_results(name, weight, input_bits):
    """int16 activations (the default) and int8 ones (--weights native-int8: vpdpbusd on VNNI,
    vpmaddubsw elsewhere, Q8's signed weights included) alike."""
    gen = torch.Generator().manual_seed(1)
    layer = make_linear(replace(weight, input_bits=input_bits), torch.randn(weight.shape[0], generator=gen))
    assert isinstance(layer, QuantizedLinear)
    assert (layer.format & 15 == IQ4) == name.startswith("IQ4")  # IQ4's table format, not its values as Q8
    # int8 inputs go by quads of inputs: a group of 6 keeps int16 for that layer
    assert layer.input_bits == (16 if weight.group % 4 else input_bits)
    x = torch.randn(25, weight.shape[1], generator=gen)
    x[4] *= 1000.0
    supported = native_kernels().supported_isas()
    for m in [*range(1, 10), 25]:
        reference = _run(layer, x[:m], "portable")
        assert torch.equal(layer(x[:m]), reference), (name, m)  # the set in use
        for isa in supported[1:]:
            assert torch.equal(_run(layer, x[:m], isa), reference), (name, isa, m)
    # and the portable path is the kernel the accuracy tests check: close to the float product
    expected = x.double() @ weight.dequantize().double().t() + layer.bias.double()
    scale = expected.abs().amax(-1, keepdim=True) + 1.0
    # (int8 rounds activations 256 times more coarsely: measured up to 7.5e-3 here)
    bound = 2e-4 if layer.input_bits == 16 else 1.5e-2
    assert float(((_run(layer, x, "portable").double() - expected).abs() / scale).max()) <= bound

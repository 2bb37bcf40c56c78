"""SwiGLU's gating (layers/activation.py, csrc/activation.cpp): the native silu(gate) * up is
within a few ulp of a float64 reference, handles the extremes like PyTorch, and gives every element
the same value however the rows are split (the one-region forward splits them over threads)."""

import pytest
import torch
import torch.nn.functional as F

from specfork.layers.activation import silu_and_mul
from specfork.native_kernels import kernels as native_kernels

pytestmark = pytest.mark.skipif(native_kernels() is None, reason="native kernels need a C++ compiler")


def _reference(gate_up):
    gate, up = gate_up.double().chunk(2, dim=-1)
    return F.silu(gate) * up


@pytest.mark.parametrize("rows, inter", [(1, 1536), (7, 1024), (3, 37)])
def test_native_gating_matches_float64(rows, inter):
    gen = torch.Generator().manual_seed(rows * inter)
    gate_up = torch.randn(rows, 2 * inter, generator=gen) * 8  # gates far into both tails
    out = native_kernels().silu_mul(gate_up)
    ref = _reference(gate_up)
    assert out.shape == (rows, inter)
    # 2 ulp of exp plus the divide and the product: a few float32 ulp of each element
    assert torch.allclose(out.double(), ref, rtol=5e-7, atol=1e-30)
    # a row computed alone, or a range starting mid-vector, is the same bit for bit
    assert torch.equal(torch.cat([native_kernels().silu_mul(gate_up[i : i + 1]) for i in range(rows)]), out)
    shifted = torch.cat([gate_up[:, 3:inter], gate_up[:, inter + 3 :]], 1)  # every element 3 lanes earlier
    assert torch.equal(native_kernels().silu_mul(shifted), out[:, 3:])


def test_extremes_follow_pytorch():
    gate = torch.tensor([0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 100.0, float("inf"), float("-inf"), float("nan")])
    out = silu_and_mul(torch.cat([gate, torch.full_like(gate, 2.0)]))
    expected = F.silu(gate) * 2.0
    finite = expected.isfinite()
    assert torch.allclose(out[finite], expected[finite], rtol=1e-6, atol=1e-35)
    assert torch.equal(out.isnan(), expected.isnan()) and torch.equal(out.isinf(), expected.isinf())


def test_fallback_off_the_native_path():
    """A tensor that needs gradients (training) takes PyTorch's ops."""
    gate_up = torch.randn(2, 8, requires_grad=True)
    out = silu_and_mul(gate_up)
    out.sum().backward()
    assert gate_up.grad is not None


def test_native_kernels_run_without_pythons_lock():
    """The server's event loop (health, metrics, streams) runs beside the engine thread; a kernel
    that kept the GIL stalled it for the whole step (health probes at 130-700 ms under load). With
    a switch interval of a second, a counting thread gets the lock from this one only if the
    kernel call gives it up: without that it cannot count once during the call."""
    import sys
    import threading

    weight = torch.randn(2048, 1024)
    packed, x = native_kernels().pack_weight(weight), torch.randn(8, 1024)
    counted, running, stop = [0], threading.Event(), threading.Event()

    def count():
        running.set()
        while not stop.is_set():
            counted[0] += 1

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        counter = threading.Thread(target=count)
        counter.start()
        running.wait()
        for _ in range(20):  # the counting thread may be slow to wake on a loaded machine: a few tries
            before = counted[0]
            native_kernels().small_m_linear(x, packed, 2048, None)
            during = counted[0] - before
            if during:
                break
        stop.set()
        counter.join()
    finally:
        sys.setswitchinterval(interval)
    assert during > 0, "no Python ran during a native call"

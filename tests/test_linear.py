"""The linear-layer interface: the native small-M kernel and the PyTorch fallback both equal a
float64 reference, and the native kernel computes every row independently of the batch."""

import pytest
import torch

from specfork.layers.linear import DenseLinear, set_batch_invariant
from specfork.native_kernels import kernels as native_kernels


def _reference(x, w, b):
    y = x.double() @ w.double().t()
    return (y if b is None else y + b.double()).float()


@pytest.fixture(scope="module")
def kernels():
    module = native_kernels()
    assert module is not None, "install.sh builds the native kernel; it must be available in the test env"
    return module


@pytest.mark.parametrize("n, k", [(1, 7), (33, 64), (100, 37), (576, 576), (1536, 576), (4099, 96)])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 17, 40])
def test_native_kernel_matches_float64(kernels, n, k, rows):
    gen = torch.Generator().manual_seed(n * 1000 + k + rows)
    w = torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen)
    x = torch.randn(rows, k, generator=gen)
    layer = DenseLinear(w, b)
    assert layer.packed is not None
    y = layer(x)
    assert y.shape == (rows, n)
    tol = 1e-5 * k**0.5 * 4
    torch.testing.assert_close(y, _reference(x, w, b), atol=tol, rtol=1e-5)
    torch.testing.assert_close(DenseLinear(w)(x), _reference(x, w, None), atol=tol, rtol=1e-5)


def test_native_kernel_rows_are_batch_invariant(kernels):
    gen = torch.Generator().manual_seed(0)
    layer = DenseLinear(torch.randn(300, 128, generator=gen))
    x = torch.randn(64, 128, generator=gen)
    alone = [layer(x[i : i + 1])[0] for i in range(64)]
    for rows in (2, 6, 8, 13, 64):
        out = layer(x[:rows])
        assert all(torch.equal(out[i], alone[i]) for i in range(rows))
    noisy = x.clone()
    noisy[1:] *= 1000  # other rows' values cannot leak into row 0
    assert torch.equal(layer(noisy[:8])[0], alone[0])


def test_native_kernel_rejects_bad_shapes(kernels):
    layer = DenseLinear(torch.randn(10, 16))
    with pytest.raises(RuntimeError, match="16"):
        layer(torch.randn(3, 15))


def test_fallback_paths_match_reference():
    """Without the native kernel (as on a machine with no compiler) the PyTorch paths are used."""
    gen = torch.Generator().manual_seed(1)
    w, b = torch.randn(70, 48, generator=gen), torch.randn(70, generator=gen)
    layer = DenseLinear(w, b)
    layer.packed = None
    layer.weight_t = torch.nn.Parameter(w.t().contiguous(), requires_grad=False)
    for rows in (1, 2, 3, 12):
        x = torch.randn(rows, 48, generator=gen)
        torch.testing.assert_close(layer(x), _reference(x, w, b), atol=1e-4, rtol=1e-5)
    set_batch_invariant(layer, True)
    x = torch.randn(12, 48, generator=gen)
    alone = [layer(x[i : i + 1])[0] for i in range(12)]
    together = layer(x)
    assert all(torch.equal(together[i], alone[i]) for i in range(12))

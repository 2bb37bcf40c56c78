"""The native paged-attention kernel (decode and verification steps) against a float64 reference:
GQA, contexts split into several chunks, head sizes on and off the vector width, and batch
invariance (a query's output is bit-identical alone or next to other queries)."""

from __future__ import annotations

import pytest
import torch

from specfork.layers.cpu_kernels import kernels

needs_kernel = pytest.mark.skipif(kernels() is None, reason="native kernels need a C++ compiler")


def _reference(q, cache, tables, seq_of, pos_of, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    _, _, bs, hkv, d = cache.shape
    group = q.shape[1] // hkv
    for t in range(q.shape[0]):
        n = int(pos_of[t]) + 1
        slots = [int(tables[seq_of[t], i // bs]) * bs + i % bs for i in range(n)]
        keys = cache[0].reshape(-1, hkv, d)[slots].double()  # [n, Hkv, D]
        values = cache[1].reshape(-1, hkv, d)[slots].double()
        for h in range(q.shape[1]):
            weights = torch.softmax(keys[:, h // group] @ q[t, h].double() * scale, dim=0)
            out[t, h] = weights @ values[:, h // group]
    return out


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 20])
def test_native_paged_attention_matches_reference_and_is_batch_invariant(head_dim):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hq, hkv = 64, 16, 9, 3
    cache = torch.randn(2, num_blocks, bs, hkv, head_dim, generator=gen)
    tables = torch.randperm(num_blocks, generator=gen)[:60].view(2, 30)  # two sequences, scattered blocks
    positions = [0, 5, 127, 128, 300, 301, 302, 450]  # one chunk, chunk edges, several chunks
    seq_of = torch.tensor([i % 2 for i in range(len(positions))])
    pos_of = torch.tensor(positions)
    q = torch.randn(len(positions), hq, head_dim, generator=gen) * 3
    native = kernels().paged_attention_decode(q, cache, tables, seq_of, pos_of, 0.125)
    reference = _reference(q, cache, tables, seq_of, pos_of, 0.125)
    assert float((native.double() - reference).abs().max()) <= 2e-5
    for t in range(len(positions)):  # alone == in the batch, bit for bit
        alone = kernels().paged_attention_decode(q[t : t + 1], cache, tables, seq_of[t : t + 1], pos_of[t : t + 1], 0.125)
        assert torch.equal(alone[0], native[t])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernels().paged_attention_decode(q, cache, tables, seq_of, pos_of, 0.125), native)
    finally:
        torch.set_num_threads(threads)

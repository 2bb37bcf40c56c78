"""The native paged-attention kernel (decode and verification steps) against a float64 reference:
GQA, contexts split into several chunks, head sizes on and off the vector width, batch
invariance (a query's output is bit-identical alone, inside a verification window of its
sequence, or next to other sequences' queries), and identical results on every instruction set
this CPU runs (portable C++, AVX2, AVX-512)."""

from __future__ import annotations

import pytest
import torch

from specfork.native_kernels import kernels

needs_kernel = pytest.mark.skipif(kernels() is None, reason="native kernels need a C++ compiler")


def _reference(q, cache, tables, seq_of, pos_of, scale):
    out = torch.empty(q.shape, dtype=torch.float64)
    _, _, hkv, bs, d = cache.shape  # [2, blocks, KV heads, block size, head dim]
    group = q.shape[1] // hkv
    for t in range(q.shape[0]):
        n = int(pos_of[t]) + 1
        where = [(int(tables[seq_of[t], i // bs]), i % bs) for i in range(n)]
        keys = torch.stack([cache[0, b, :, o] for b, o in where]).double()  # [n, Hkv, D]
        values = torch.stack([cache[1, b, :, o] for b, o in where]).double()
        for h in range(q.shape[1]):
            weights = torch.softmax(keys[:, h // group] @ q[t, h].double() * scale, dim=0)
            out[t, h] = weights @ values[:, h // group]
    return out


def _case(head_dim, dtype=torch.float32):
    gen = torch.Generator().manual_seed(0)
    num_blocks, bs, hq, hkv = 64, 16, 9, 3
    cache = torch.randn(2, num_blocks, hkv, bs, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:60].view(2, 30)  # two sequences, scattered blocks
    # Decode queries of alternating sequences (one chunk, chunk edges, several chunks), then
    # verification windows: 3 queries of sequence 0 across a chunk edge, 10 of sequence 1 (more than
    # one run of the kernel), and a window out of position order.
    positions = [0, 5, 127, 128, 300, 301, 302, 450] + [126, 127, 128] + list(range(250, 260)) + [40, 9, 41]
    seq_of = torch.tensor([i % 2 for i in range(8)] + [0] * 3 + [1] * 10 + [0] * 3)
    pos_of = torch.tensor(positions)
    q = torch.randn(len(positions), hq, head_dim, generator=gen) * 3
    return q, cache, tables, seq_of, pos_of


@needs_kernel
@pytest.mark.parametrize("head_dim, dtype", [(64, torch.float32), (20, torch.float32), (64, torch.float16)])
def test_native_paged_attention_matches_reference_and_is_batch_invariant(head_dim, dtype):
    q, cache, tables, seq_of, pos_of = _case(head_dim, dtype)
    native = kernels().paged_attention_decode(q, cache, tables, seq_of, pos_of, 0.125)
    reference = _reference(q, cache.float(), tables, seq_of, pos_of, 0.125)
    assert float((native.double() - reference).abs().max()) <= 2e-5
    for t in range(len(pos_of)):  # alone == in the batch, bit for bit
        alone = kernels().paged_attention_decode(q[t : t + 1], cache, tables, seq_of[t : t + 1], pos_of[t : t + 1], 0.125)
        assert torch.equal(alone[0], native[t])
    window = slice(8, 11)  # a verification window alone == the same window among other queries
    alone = kernels().paged_attention_decode(q[window], cache, tables, seq_of[window], pos_of[window], 0.125)
    assert torch.equal(alone, native[window])
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert torch.equal(kernels().paged_attention_decode(q, cache, tables, seq_of, pos_of, 0.125), native)
    finally:
        torch.set_num_threads(threads)


@needs_kernel
def test_native_paged_attention_reads_each_querys_own_keys():
    """A window's queries see different numbers of keys: changing a key that only the last query
    sees changes only its output (the kernel must not let the others read past their position)."""
    q, cache, tables, seq_of, pos_of = _case(64)
    window = slice(11, 21)  # positions 250..259 of sequence 1
    before = kernels().paged_attention_decode(q[window], cache, tables, seq_of[window], pos_of[window], 0.125)
    cache[:, int(tables[1, 259 // 16]), :, 259 % 16] += 1.0
    after = kernels().paged_attention_decode(q[window], cache, tables, seq_of[window], pos_of[window], 0.125)
    assert torch.equal(after[:-1], before[:-1]) and not torch.equal(after[-1], before[-1])


@needs_kernel
@pytest.mark.parametrize("head_dim, heads, kv_heads, dtype", [
    (64, 9, 3, torch.float32), (64, 9, 3, torch.float16), (128, 4, 1, torch.float32), (20, 9, 3, torch.float32),
    (64, 4, 4, torch.float32), (64, 8, 4, torch.float16)])
def test_every_instruction_set_gives_identical_attention(head_dim, heads, kv_heads, dtype):
    """The portable loops, AVX2 (one query and head at a time) and AVX-512 (two or, with heads of
    64, up to four at a time when they see the same number of keys; three as four with one
    repeated) run the same float operations in the same order: bit for bit equal, for decode
    queries, verification windows whose queries group and do not, keys past the last whole block
    of 8 (the exp tail) and of 4, scores far below the max (the exp floor), GQA groups of 3 and 2,
    and without GQA (groups across queries)."""
    gen = torch.Generator().manual_seed(head_dim + heads)
    num_blocks, bs = 80, 16
    cache = torch.randn(2, num_blocks, kv_heads, bs, head_dim, generator=gen).to(dtype)
    tables = torch.randperm(num_blocks, generator=gen)[:78].view(2, 39)
    positions = [0, 3, 7, 8, 130, 255, 256, 600] + list(range(120, 128)) + [129, 131, 140] + list(range(300, 306))
    seq_of = torch.tensor([i % 2 for i in range(8)] + [0] * 8 + [1] * 3 + [0] * 6)
    pos_of = torch.tensor(positions)
    q = torch.randn(len(positions), heads, head_dim, generator=gen) * 3
    q[-1] *= 40  # scores that span more than the exp floor (-87) below their max
    isas = kernels().supported_isas()
    assert isas[0] == "portable"
    reference = kernels().paged_attention_decode_isa(q, cache, tables, seq_of, pos_of, 0.125, "portable")
    exact = _reference(q, cache.float(), tables, seq_of, pos_of, 0.125)
    assert float((reference.double() - exact).abs().max()) <= 2e-5
    for isa in isas[1:]:
        assert torch.equal(kernels().paged_attention_decode_isa(q, cache, tables, seq_of, pos_of, 0.125, isa),
                           reference), isa
    assert torch.equal(kernels().paged_attention_decode(q, cache, tables, seq_of, pos_of, 0.125), reference)
    with pytest.raises(RuntimeError, match="unknown instruction set"):
        kernels().paged_attention_decode_isa(q, cache, tables, seq_of, pos_of, 0.125, "sse9")

"""Quantised weights on 2 MB pages.

A decode step streams every weight of the model once (96 MB for the embedded model). On 4 KB
pages that is some 24,000 pages a step, far more than a core's TLB holds, so nearly every page
costs a page walk while the kernel waits for its weights. Linux gives an anonymous mapping 2 MB
pages (transparent huge pages) where the process asks for them with ``madvise``, which PyTorch's
allocator does not do; ``move_to_huge_pages`` copies tensors into one such mapping and points
them at it. The bytes are the same, so every result is too. (Measured on a 2-core Intel Xeon,
one process, alternating: the 1-row forward of the embedded model 0.89x the time, a 6-row
verification 0.97x; docs/benchmarks.md.)
"""

from __future__ import annotations

import mmap
from pathlib import Path

import torch

HUGE_PAGE = 2 << 20
ALIGNMENT = 64  # bytes between tensors in the mapping (PyTorch's own CPU alignment)
THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def huge_pages_available() -> bool:
    """Whether this system gives a mapping 2 MB pages on request (Linux with transparent huge pages
    not set to ``never``)."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        return "[never]" not in THP_SETTING.read_text()
    except OSError:
        return False


def move_to_huge_pages(tensors: list[torch.Tensor]) -> int:
    """Copy ``tensors`` (contiguous CPU tensors, each its own: parameters are moved in place, their
    ``.data`` replaced) into one anonymous mapping on 2 MB pages. Returns the bytes moved: 0 where
    huge pages are unavailable (the tensors stay as they are). The mapping lives as long as a
    tensor that views it."""
    tensors = [t for t in tensors if t.numel()]
    if not tensors or not huge_pages_available():
        return 0
    if any(t.device.type != "cpu" or not t.is_contiguous() for t in tensors):
        raise ValueError("only contiguous CPU tensors can be moved to huge pages")
    sizes = [-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in tensors]
    length = -(-sum(sizes) // HUGE_PAGE) * HUGE_PAGE + HUGE_PAGE  # one more page to align the start
    region = mmap.mmap(-1, length, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    arena = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive
    offset = -arena.data_ptr() % HUGE_PAGE
    for t, size in zip(tensors, sizes, strict=True):
        view = arena[offset : offset + t.nbytes].view(t.dtype).view(t.shape)
        view.copy_(t.data)
        t.data = view
        offset += size
    return sum(t.nbytes for t in tensors)

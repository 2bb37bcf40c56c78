"""Quantised weights on 2 MB pages (loading/huge_pages.py): the same values, the same outputs,
and the pages really are huge where Linux offers them."""

from __future__ import annotations

import pytest
import torch

from specfork import LLM, SamplingParams
from specfork.loading import huge_pages, loader
from specfork.loading.gguf_export import export_gguf
from specfork.loading.huge_pages import ALIGNMENT, HUGE_PAGE, huge_pages_available, move_to_huge_pages
from specfork.native_kernels import kernels as native_kernels

needs_thp = pytest.mark.skipif(not huge_pages_available(), reason="this system has no transparent huge pages")


def huge_bytes_at(address: int) -> int:
    """AnonHugePages (bytes) of the mapping of this process that holds ``address``."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            fields = line.split()
            if "-" in fields[0] and ":" not in fields[0]:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                inside = start <= address < end
            elif inside and fields[0] == "AnonHugePages:":
                return int(fields[1]) * 1024
    raise AssertionError(f"no mapping holds {address:#x}")


def packed_tensors(llm) -> list[torch.Tensor]:
    tensors = [t for t in loader.packed_weights(llm.engine.runner.model) if t.numel()]  # empty ones stay put
    assert tensors
    return tensors


def moved_together(tensors: list[torch.Tensor]) -> bool:
    """Whether ``tensors`` lie back to back from a 2 MB boundary, each ALIGNMENT-aligned, as
    ``move_to_huge_pages`` lays them out (PyTorch's allocator gives each its own block)."""
    address = tensors[0].data_ptr()
    if address % HUGE_PAGE:
        return False
    for t in tensors:
        if t.data_ptr() != address:
            return False
        address += -(-t.nbytes // ALIGNMENT) * ALIGNMENT
    return True


@needs_thp
def test_moved_tensors_keep_their_values_and_sit_on_huge_pages():
    weight = torch.nn.Parameter(torch.randint(0, 255, (3 << 20,), dtype=torch.uint8), requires_grad=False)
    scales = torch.randn(1000, 7)
    empty = torch.empty(0)
    before = weight.clone(), scales.clone()
    moved = move_to_huge_pages([weight, scales, empty])
    assert moved == weight.nbytes + scales.nbytes
    assert isinstance(weight, torch.nn.Parameter)  # moved in place
    assert torch.equal(weight, before[0]) and torch.equal(scales, before[1])
    assert weight.data_ptr() % HUGE_PAGE == 0
    assert huge_bytes_at(weight.data_ptr()) >= HUGE_PAGE
    assert huge_bytes_at(scales.data_ptr()) >= HUGE_PAGE  # the same mapping


def test_nothing_moves_where_huge_pages_are_off(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    t = torch.randn(1000, 1000)
    address = t.data_ptr()
    assert move_to_huge_pages([t]) == 0 and t.data_ptr() == address


@needs_thp
def test_only_contiguous_cpu_tensors_move():
    with pytest.raises(ValueError, match="contiguous CPU"):
        move_to_huge_pages([torch.randn(64, 64).t()])


@needs_thp
@pytest.mark.skipif(native_kernels() is None, reason="the native kernels are not built")
def test_a_native_model_reads_its_weights_from_huge_pages_and_decodes_the_same(tiny_checkpoints, tmp_path,
                                                                                 monkeypatch):
    path = str(export_gguf(tiny_checkpoints["llama-gqa-tied"].path, tmp_path / "tiny-q4_1.gguf", vocab_from=None,
                           out_type="q4_1"))
    prompts = [[1, 5, 9, 2], [3, 3, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    llm = LLM(path)
    tensors = packed_tensors(llm)
    assert moved_together(tensors)  # in the one mapping move_to_huge_pages made ...
    assert huge_bytes_at(tensors[0].data_ptr()) > 0  # ... which has huge pages
    moved = [o.token_ids for o in llm.generate(prompts, params)]
    llm.close()
    monkeypatch.setattr(loader, "move_to_huge_pages", lambda tensors: 0)
    with LLM(path) as plain:
        assert not moved_together(packed_tensors(plain))  # the layout check tells the two apart
        assert [o.token_ids for o in plain.generate(prompts, params)] == moved

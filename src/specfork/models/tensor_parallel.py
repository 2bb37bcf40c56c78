"""Which part of each weight one tensor-parallel rank holds (Megatron-style splitting).

* q/k/v (and their biases) and gate/up are column-parallel: a rank holds the output rows of its
  attention heads and of its slice of the MLP's intermediate units;
* o and down are row-parallel: a rank holds the matching input columns, and the partial outputs
  of all ranks are summed (one all-reduce each, ``TensorShard.reduce``); a bias of theirs is
  added by rank 0 alone;
* everything else (embedding, norms, q/k norms, LM head) is replicated.

KV heads are split as evenly as possible, each with its group of query heads, so a model whose
heads do not divide by the rank count still splits (SmolLM2-135M: 3 KV heads over 2 ranks is
2 + 1, i.e. 6 + 3 query heads). With fewer KV heads than ranks, query heads are split evenly
and each rank keeps a copy of the KV heads its queries read (as vLLM does). Intermediate units
are split in steps of the quantisation group, so GGUF's blocks are never cut.

The model is built from the local view (``local_arch``: this rank's head and unit counts) and
knows nothing else of parallelism than the ``reduce`` it calls after o and down (the ranks and
their collectives are parallel/group.py's).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from specfork.errors import ModelLoadError
from specfork.layers.quantized import QuantizedWeight
from specfork.models.config import ModelArchConfig
from specfork.models.llama import Reduce, WeightSource

_UNITS = (128, 64, 32)  # intermediate split granularity: every quantisation group divides one of them


@dataclass(frozen=True)
class TensorShard:
    rank: int
    size: int
    reduce: Reduce  # sums a row-parallel projection's partial outputs over the ranks, in place or not

    def heads(self, arch: ModelArchConfig) -> tuple[range, range]:
        """(query heads, KV heads) of this rank, as index ranges into the model's heads."""
        hq, hkv, n = arch.num_heads, arch.num_kv_heads, self.size
        group = hq // hkv
        if hkv >= n:
            kv = _even(hkv, n)[self.rank]
            return range(kv.start * group, kv.stop * group), kv
        if n % hkv or hq % n:
            raise ModelLoadError(
                f"cannot split {hq} query / {hkv} KV heads over {n} tensor-parallel ranks: with fewer KV heads "
                "than ranks, the ranks must be a multiple of the KV heads and divide the query heads"
            )
        q = _even(hq, n)[self.rank]
        kv_head = q.start // group
        return q, range(kv_head, kv_head + 1)

    def units(self, arch: ModelArchConfig) -> range:
        """This rank's intermediate units of the MLP."""
        size = arch.intermediate_size
        step = next((u for u in _UNITS if size % u == 0 and size // u >= self.size), 1)
        chunk = _even(size // step, self.size)[self.rank]
        return range(chunk.start * step, chunk.stop * step)

    def local_arch(self, arch: ModelArchConfig) -> ModelArchConfig:
        """The model as this rank builds it: its own head and unit counts."""
        q, kv = self.heads(arch)
        return replace(arch, num_heads=len(q), num_kv_heads=len(kv), intermediate_size=len(self.units(arch)))

    def source(self, take: WeightSource, arch: ModelArchConfig) -> WeightSource:
        """``take`` restricted to this rank's part of each tensor (HF names)."""
        q, kv = self.heads(arch)
        d = arch.head_dim
        units = self.units(arch)
        rows = {
            "q_proj": (q.start * d, q.stop * d),
            "k_proj": (kv.start * d, kv.stop * d),
            "v_proj": (kv.start * d, kv.stop * d),
            "gate_proj": (units.start, units.stop),
            "up_proj": (units.start, units.stop),
        }
        columns = {"o_proj": (q.start * d, q.stop * d), "down_proj": (units.start, units.stop)}

        def take_part(name: str):
            tensor = take(name)
            if tensor is None:
                return None
            parts = name.split(".")
            proj, kind = (parts[-2], parts[-1]) if len(parts) >= 2 else ("", "")
            if proj in rows:
                return _rows(tensor, *rows[proj])
            if proj in columns:
                if kind == "bias":  # added once, after the sum
                    return tensor if self.rank == 0 else None
                return _columns(tensor, *columns[proj], name)
            return tensor

        return take_part


def _even(total: int, parts: int) -> list[range]:
    """``total`` items split into ``parts`` contiguous ranges, sizes differing by at most one."""
    base, extra = divmod(total, parts)
    out, start = [], 0
    for i in range(parts):
        stop = start + base + (i < extra)
        out.append(range(start, stop))
        start = stop
    return out


def _rows(tensor, start: int, stop: int):
    if isinstance(tensor, QuantizedWeight):
        return tensor.rows(torch.arange(start, stop))
    return tensor[start:stop].contiguous()


def _columns(tensor, start: int, stop: int, name: str):
    if isinstance(tensor, QuantizedWeight):
        try:
            return tensor.columns(start, stop)
        except ValueError as e:
            raise ModelLoadError(f"cannot split {name} across tensor-parallel ranks: {e}") from None
    return tensor[:, start:stop].contiguous()

"""Decode and verify steps replayed as CUDA graphs.

On a GPU a small model's eager forward is bound by kernel launches, not by the GPU: each layer
is a chain of small kernels, each launched from Python (measured on an H100: 24 ms per decode
step of the 30-layer embedded model, docs/benchmarks.md). A captured graph launches the whole
forward at once.

A graph replays fixed shapes on fixed buffers, so a step is graphed when its shape is one of a
few: ``batch`` sequences (a power of two, at most ``max_seqs``) that each compute ``rows`` new
tokens (a decode step: 1; a verify window: k+1) under the causal mask, attending to ``keys`` key
slots, a power of two of at least ``MIN_KEYS``. A step is padded to its graph's shape: shorter
windows to the longest, the batch with whole sequences. Padded rows repeat a real row, write a
scratch slot no sequence owns, and their outputs are dropped (rows are computed independently of
each other). The step's inputs are copied into static buffers; block-table entries past a
sequence's blocks point at block 0 and the mask, computed inside the graph from the positions,
hides every slot past a token's position, so the padding changes what is computed only by
exact zeros (masked keys get weight 0) on the batch-invariant path (``--deterministic``), and on
the default path by the kernels' own rounding. The first step of a shape runs eagerly through
the same static path and is captured after it (it writes the same keys and values the replay
would); later steps of that shape replay. At most ``MAX_GRAPHS`` are kept; other steps run
eagerly, and so does every step after a capture that failed (logged once).

Without ``capture`` (on the CPU, in tests) every step runs the static path eagerly, which tests
the padding and masking that the graphs replay.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from specfork.layers.attention import AttentionMetadata

logger = logging.getLogger(__name__)

MIN_KEYS = 256  # the smallest key bucket
MAX_GRAPHS = 64  # graphs kept per model; steps of other shapes run eagerly

# forward(ids, positions, meta, logits, *inputs) -> the step's output (a tensor or a tuple of them)
Forward = Callable[..., torch.Tensor | tuple[torch.Tensor, ...]]


class StepGraphs:
    def __init__(self, forward: Forward, *, max_seqs: int, max_rows: int, max_keys: int, block_size: int,
                 device: torch.device, capture: bool, scratch_slot: int | None = None) -> None:
        """``forward(ids, positions, meta, logits, *inputs)``: the model's forward over its KV caches.
        ``max_seqs`` x ``max_rows``: the largest step graphed; ``max_keys``: the longest context.
        ``scratch_slot``: a cache slot no sequence owns, where padded rows write (None: steps
        whose sequences compute different numbers of rows run eagerly)."""
        self.forward = forward
        self.scratch_slot = scratch_slot
        self.failed = False  # a capture failed: every step runs eagerly
        self.max_seqs, self.max_rows, self.block_size = max_seqs, max_rows, block_size
        self.max_keys = _bucket(max(max_keys, 1), block_size)
        self.capture = capture
        tokens = max_seqs * max_rows

        def buffer(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.ids, self.positions, self.slots = buffer(tokens), buffer(tokens), buffer(tokens)
        self.tables = buffer(max_seqs, self.max_keys // block_size)
        self.key_index = torch.arange(self.max_keys, dtype=torch.long, device=device)
        self.inputs: list[torch.Tensor] = []  # static buffers of the forward's further per-row inputs
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, object]] = {}
        self.pool = None  # the graphs' one memory pool, made at the first capture

    @torch.inference_mode()  # the buffers are made and updated in inference mode, whoever calls
    def run(self, ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, logits: bool,
            *inputs: torch.Tensor):
        """The forward's output for a prepared causal step, or None when the step does not fit a
        graph. The step is padded to its graph's shape: sequences computing fewer rows than the
        longest (``meta.pad_index``) get rows that repeat their first row, and the batch grows to
        a power of two (at most ``max_seqs``) with sequences that repeat the step's first row;
        every padded row writes the scratch slot and its output is dropped. ``inputs``: further
        per-row inputs of the forward ([tokens, ...] each, e.g. an EAGLE-3 head's hidden
        states), copied into static buffers like the ids."""
        if self.failed:
            return None
        batch, rows = meta.block_tables.shape[0], meta.q_max
        keys = _bucket(meta.k_max, self.block_size)
        if batch > self.max_seqs or rows > self.max_rows or keys > self.max_keys:
            return None
        graph_batch = min(1 << (batch - 1).bit_length(), self.max_seqs)
        uneven = ids.shape[0] != batch * rows
        padded = uneven or graph_batch != batch
        if padded and (self.scratch_slot is None or uneven and meta.pad_index is None):
            return None
        shape = (graph_batch, rows, keys, logits, meta.batch_invariant, len(inputs))
        if self.capture and shape not in self.graphs and len(self.graphs) >= MAX_GRAPHS:
            return None
        buffers = self._input_buffers(inputs)
        if buffers is None:
            return None
        tokens = graph_batch * rows
        slots = meta.slot_mapping
        if padded:
            grid, real_rows = self._grid(ids.shape[0], batch * rows, tokens, meta, uneven, ids.device)
            real = torch.zeros(tokens, dtype=torch.bool, device=ids.device)
            real[real_rows] = True
            ids, positions, inputs = ids[grid], positions[grid], tuple(x[grid] for x in inputs)
            slots = torch.where(real, slots[grid], self.scratch_slot)
        self.ids[:tokens].copy_(ids)
        self.positions[:tokens].copy_(positions)
        self.slots[:tokens].copy_(slots)
        for buffer, x in zip(buffers, inputs, strict=True):
            buffer[:tokens].copy_(x)
        tables = self.tables[:graph_batch, : keys // self.block_size]
        tables.zero_()
        tables[:batch, : meta.block_tables.shape[1]].copy_(meta.block_tables)
        out = self._replay_or_capture(shape)
        if padded:  # the real rows, in the flat order (a new tensor: no copy needed)
            return _rows(out, lambda t: t.index_select(0, real_rows))
        return out

    @staticmethod
    def _grid(flat: int, grid_rows: int, tokens: int, meta: AttentionMetadata, uneven: bool, device: torch.device):
        """(for each of the graph's ``tokens`` rows the flat row it repeats, the graph row of each
        of the ``flat`` rows). The first ``grid_rows`` are the step's own [batch, rows] grid
        (padded per sequence by ``meta.pad_index`` when its windows are ``uneven``); the rest,
        whole padded sequences, repeat flat row 0."""
        if uneven:
            grid, real_rows = meta.pad_index, meta.unpad_index
        else:
            grid = real_rows = torch.arange(flat, device=device)
        if tokens > grid_rows:
            grid = torch.cat([grid, grid.new_zeros(tokens - grid_rows)])
        return grid, real_rows

    def _replay_or_capture(self, shape: tuple):
        if not self.capture:
            return self._static_forward(shape)
        captured = self.graphs.get(shape)
        if captured is None:
            out = self._static_forward(shape)  # also the warm-up the capture needs
            try:
                self.graphs[shape] = self._capture(shape)
            except RuntimeError as e:  # an operation that cannot be captured: eager from now on
                self.failed = True
                logger.warning("CUDA graph capture failed (%s); decode steps run eagerly", str(e).splitlines()[0])
            return out
        graph, static_out = captured
        graph.replay()
        # graphs share one memory pool: copy the output out before another graph replays
        return _rows(static_out, torch.Tensor.clone)

    def _input_buffers(self, inputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor] | None:
        """The static buffers of ``inputs`` (made on first use); None if an input's row shape or
        dtype differs from its buffer's."""
        for x in inputs[len(self.inputs):]:
            self.inputs.append(torch.zeros(self.ids.shape[0], *x.shape[1:], dtype=x.dtype, device=self.ids.device))
        buffers = self.inputs[: len(inputs)]
        if any(b.shape[1:] != x.shape[1:] or b.dtype != x.dtype for b, x in zip(buffers, inputs, strict=True)):
            return None
        return buffers

    def reset(self) -> None:
        """Forget every captured graph (the forward changed what it returns)."""
        self.graphs.clear()

    def _capture(self, shape: tuple) -> tuple[torch.cuda.CUDAGraph, object]:
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            static_out = self._static_forward(shape)
        return graph, static_out

    def _static_forward(self, shape: tuple):
        batch, rows, keys, logits, invariant, num_inputs = shape
        tokens = batch * rows
        positions = self.positions[:tokens]
        visible = self.key_index[:keys] <= positions.view(batch, rows, 1)  # causal, padding hidden
        meta = AttentionMetadata(
            slot_mapping=self.slots[:tokens],
            block_tables=self.tables[:batch, : keys // self.block_size],
            k_max=keys,
            mask=visible.unsqueeze(1),
            q_max=rows,
            pad_index=None,
            unpad_index=None,
            batch_invariant=invariant,
        )
        return self.forward(self.ids[:tokens], positions, meta, logits,
                            *(buffer[:tokens] for buffer in self.inputs[:num_inputs]))


def _rows(out, select):
    """``select`` applied to the output, a tensor or a tuple of them."""
    return tuple(select(t) for t in out) if isinstance(out, tuple) else select(out)


def _bucket(keys: int, block_size: int) -> int:
    """The key bucket of a context of ``keys`` slots: a power of two, at least MIN_KEYS, rounded
    up to whole blocks."""
    bucket = max(MIN_KEYS, 1 << (keys - 1).bit_length())
    return -(-bucket // block_size) * block_size

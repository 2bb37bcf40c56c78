"""Owns the device side of one model: its weights, its KV cache, input preparation and the
forward pass. Target and draft models each get their own runner (composition, no subclassing)."""

from __future__ import annotations

import torch

from specfork.engine.logprobs import record_prompt_logprobs
from specfork.engine.scheduler import ScheduledBatch
from specfork.engine.step_graphs import StepGraphs
from specfork.errors import EngineFailure
from specfork.layers.attention import AttentionMetadata, new_kv_cache
from specfork.layers.linear import set_batch_invariant
from specfork.layers.quantized import QuantizedLinear
from specfork.models.llama import LlamaForCausalLM
from specfork.native_kernels import kernels as native_kernels
from specfork.outputs import TokenLogprob

NATIVE_PARTIAL_BYTES = 64 << 20  # most per-chunk partial results one native attention call keeps


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        *,
        num_blocks: int,
        block_size: int,
        device: torch.device,
        deterministic: bool = False,
        kv_dtype: torch.dtype | None = None,
        parallel=None,
        cuda_graphs: bool = False,
        max_seqs: int = 32,
        max_rows: int = 9,
    ) -> None:
        """``parallel``: the tensor-parallel group (parallel/group.py) when ``model`` is rank 0's
        shard; every forward's inputs then go to the other ranks first.
        ``deterministic``: decode and verify steps use batch-invariant kernels, so a token's
        logits do not depend on how many tokens or sequences share its forward pass.
        ``kv_dtype``: the KV cache's element type (default: ``default_kv_dtype``).
        ``cuda_graphs``: on CUDA, replay decode and verify steps of up to ``max_seqs`` sequences
        of up to ``max_rows`` new tokens each as CUDA graphs (engine/step_graphs.py)."""
        cfg = model.config
        self.model = model
        self.parallel = parallel
        self.deterministic = deterministic
        set_batch_invariant(model, deterministic)
        dtype = model.embed_tokens.weight.dtype
        kv_dtype = kv_dtype or default_kv_dtype(model, device)
        self.native_attention_available = (
            device.type == "cpu" and dtype == torch.float32 and kv_dtype in (torch.float32, torch.float16)
            and native_kernels() is not None
        )
        # keys per chunk of the native attention kernel's partial results (sizes prefill slices)
        self._attention_chunk = native_kernels().attention_chunk() if self.native_attention_available else 0
        self.device = device
        self.block_size = block_size
        self.num_blocks = num_blocks
        # One block more than the block manager hands out: the scratch block, where the padded
        # rows of a graphed step write (engine/step_graphs.py); no sequence ever reads it.
        self.kv_caches = [
            new_kv_cache(num_blocks + 1, block_size, cfg.num_kv_heads, cfg.head_dim, dtype=kv_dtype, device=device)
            for _ in range(cfg.num_layers)
        ]
        self.feature_layers: tuple[int, ...] = ()
        # With feature_layers set: the features of every token the last pass computed, [T, n * hidden]
        # in the pass's flat token order (LlamaForCausalLM.forward's capture); valid until the next pass.
        self.features: torch.Tensor | None = None
        self.graphs: StepGraphs | None = None
        if cuda_graphs and device.type == "cuda" and parallel is None:
            self.graphs = self.static_steps(max_seqs, max_rows, capture=True)

    def static_steps(self, max_seqs: int, max_rows: int, *, capture: bool, forward=None) -> StepGraphs:
        """Graphed (``capture``) or eager static-shape steps over this runner's caches, running
        ``forward`` (default: the model's forward, ``_model_forward``)."""
        max_keys = min(self.num_blocks * self.block_size, self.model.rotary.cos.shape[0])
        return StepGraphs(forward or self._model_forward, max_seqs=max_seqs, max_rows=max_rows, max_keys=max_keys,
                          block_size=self.block_size, device=self.device, capture=capture,
                          scratch_slot=self.num_blocks * self.block_size)

    def capture_features(self, layers: tuple[int, ...]) -> None:
        """From now on, keep the inputs of ``layers`` of every pass in ``features`` (for a drafter
        that reads the target's features); nothing is captured or paid for without it."""
        if any(not 0 <= i < self.model.config.num_layers for i in layers):
            raise ValueError(f"feature layers {list(layers)} outside 0..{self.model.config.num_layers - 1}")
        self.feature_layers = tuple(layers)
        if self.graphs is not None:
            self.graphs.reset()  # captured without the features

    def prepare(
        self,
        seqs,
        starts: list[int],
        token_lists: list[list[int]],
        attn_mask: torch.Tensor | None = None,
        batch_invariant: bool = False,
        decode: bool = False,
        layout: tuple[list[list[int]], list[list[int]]] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """Inputs for computing ``token_lists[i]`` at positions ``starts[i]...`` of ``seqs[i]``.

        ``attn_mask`` [B, q_max, k_max] bool overrides the default causal visibility (tree masks).
        ``layout`` = (positions, slots): explicit RoPE positions and cache slots (indices into the
        sequence's block table) per token, for tree decoding where the two differ; it needs
        ``attn_mask`` (over slots 0..k_max-1) and ignores ``starts``.
        """
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        q_lens = [len(t) for t in token_lists]
        q_max = max(q_lens)
        if layout is not None:
            if attn_mask is None:
                raise ValueError("an explicit position/slot layout needs an explicit attention mask")
            pos_lists, slot_lists = layout
            ctx = [max(sl) + 1 for sl in slot_lists]
        else:
            pos_lists = [list(range(s, s + n)) for s, n in zip(starts, q_lens, strict=True)]
            slot_lists = pos_lists
            ctx = [s + n for s, n in zip(starts, q_lens, strict=True)]
        k_max = attn_mask.shape[-1] if attn_mask is not None else max(ctx)
        max_blocks = -(-k_max // bs)
        tables = []
        for seq, toks, pos, sl in zip(seqs, token_lists, pos_lists, slot_lists, strict=True):
            table = seq.block_table
            ids.extend(toks)
            positions.extend(pos)
            slots.extend(table[p // bs] * bs + p % bs for p in sl)
            tables.append(table[:max_blocks] + [0] * (max_blocks - min(len(table), max_blocks)))
        dev = self.device
        native = attn_mask is None and self.native_attention_available
        slices = None if decode or not native else self._native_slices(positions)
        seq_index = mask = pad_index = unpad_index = None
        # One tensor for the per-token columns, viewed row by row (fewer tensors built from lists).
        columns = [ids, positions, slots]
        if native:
            columns.append([b for b, n in enumerate(q_lens) for _ in range(n)])
        else:
            mask = self._sdpa_mask(attn_mask, starts, q_lens, ctx, k_max)
            pad_index, unpad_index = self._padding(q_lens)
        ids_t, pos_t, slots_t, *rest = torch.tensor(columns, dtype=torch.long, device=dev).unbind(0)
        if native:
            seq_index = rest[0]
        meta = AttentionMetadata(
            slot_mapping=slots_t,
            block_tables=torch.tensor(tables, dtype=torch.long, device=dev),
            k_max=k_max,
            mask=mask,
            q_max=q_max,
            pad_index=pad_index,
            unpad_index=unpad_index,
            batch_invariant=batch_invariant,
            native_attention=native,
            seq_index=seq_index,
            positions=pos_t,
            native_slices=slices,
            one_call=native and slices is None,
        )
        return ids_t, pos_t, meta

    def _native_slices(self, positions: list[int]) -> list[tuple[int, int]] | None:
        """Row ranges of a prefill pass for separate native attention calls: the kernel keeps a
        partial result per query, chunk of keys and head (csrc/paged_attention.cpp), which grows
        with queries x context, so a long pass runs in slices of at most NATIVE_PARTIAL_BYTES
        (None: the pass fits one call, and the model may run it in its one native call)."""
        cfg = self.model.config
        per_chunk = cfg.num_heads * (cfg.head_dim + 2) * 4
        slices, start, size = [], 0, 0
        for row, p in enumerate(positions):
            need = (p // self._attention_chunk + 1) * per_chunk
            if size + need > NATIVE_PARTIAL_BYTES and row > start:
                slices.append((start, row))
                start, size = row, 0
            size += need
        return None if not slices else slices + [(start, len(positions))]

    def _sdpa_mask(self, attn_mask, starts, q_lens, ctx, k_max) -> torch.Tensor | None:
        """[B, 1, q_max, k_max] visibility for the padded SDPA path (None: every query sees every
        gathered key)."""
        if attn_mask is not None:
            return attn_mask.unsqueeze(1)
        q_max = max(q_lens)
        if q_max == 1 and all(c == k_max for c in ctx):
            return None
        grid = [list(range(s, s + n)) + [0] * (q_max - n) for s, n in zip(starts, q_lens, strict=True)]
        qpos = torch.tensor(grid, dtype=torch.long, device=self.device)  # [B, q_max]
        return (torch.arange(k_max, device=self.device).view(1, 1, k_max) <= qpos.unsqueeze(2)).unsqueeze(1)

    def _padding(self, q_lens: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """Flat rows -> [B * q_max] padded rows and back (None, None when every row has q_max)."""
        q_max = max(q_lens)
        if all(n == q_max for n in q_lens):
            return None, None
        pad, unpad = [], []
        offset = 0
        for b, n in enumerate(q_lens):
            pad.extend(range(offset, offset + n))
            pad.extend([offset] * (q_max - n))
            unpad.extend(range(b * q_max, b * q_max + n))
            offset += n
        return (torch.tensor(pad, dtype=torch.long, device=self.device),
                torch.tensor(unpad, dtype=torch.long, device=self.device))

    @torch.inference_mode()
    def forward(
        self,
        seqs,
        starts: list[int],
        token_lists: list[list[int]],
        logits_rows: list[int],
        attn_mask: torch.Tensor | None = None,
        *,
        decode: bool = True,
        layout: tuple[list[list[int]], list[list[int]]] | None = None,
    ) -> torch.Tensor:
        """Run the model and return float32 logits of the flat rows ``logits_rows``.

        ``seqs`` are objects with a ``block_table``; ``decode`` marks decode/verify passes, which
        use batch-invariant attention in deterministic mode (prefill passes never need it)."""
        invariant = self.deterministic and decode
        ids, pos, meta = self.prepare(seqs, starts, token_lists, attn_mask, invariant, decode, layout)
        causal_step = decode and attn_mask is None and layout is None
        return self._logits_of(ids, pos, meta, logits_rows, causal_step)

    def _logits_of(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, rows: list[int],
                   causal_step: bool = False) -> torch.Tensor:
        """Float32 logits of the flat rows ``rows``. When every row is wanted (decode and
        verification steps) the model runs its LM head itself: inside its one native call where it
        has one. ``causal_step``: a decode or verify step under the causal mask (it may replay a
        CUDA graph)."""
        if rows == list(range(ids.shape[0])):
            return self._run(ids, pos, meta, logits=True, causal_step=causal_step)
        return self._logits(self._run(ids, pos, meta, causal_step=causal_step), rows)

    def _run(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, logits: bool = False,
             causal_step: bool = False) -> torch.Tensor:
        if self.parallel is None:
            return self._forward(ids, pos, meta, logits, causal_step)
        self.parallel.send_forward(ids, pos, meta)
        try:
            return self._forward(ids, pos, meta, logits, causal_step)
        except EngineFailure:
            raise
        except BaseException as e:  # the shards are inside this forward: they cannot go on
            self.parallel.fail(f"rank 0 failed during a forward ({type(e).__name__})")
            raise

    def _forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, logits: bool,
                 causal_step: bool) -> torch.Tensor:
        """Hidden states after the final norm, or with ``logits`` the logits of every row."""
        out = self.graphs.run(ids, pos, meta, logits) if causal_step and self.graphs is not None else None
        if out is None:
            out = self._model_forward(ids, pos, meta, logits)
        if self.feature_layers:
            out, self.features = out
        return out

    def _model_forward(self, ids: torch.Tensor, pos: torch.Tensor, meta: AttentionMetadata, logits: bool):
        """The model's output, with the captured features when ``feature_layers`` are set."""
        if not self.feature_layers:
            return self.model(ids, pos, self.kv_caches, meta, logits=logits)
        return self.model(ids, pos, self.kv_caches, meta, self.feature_layers, logits=logits)

    @property
    def decodes_in_one_call(self) -> bool:
        """Whether ``decode_steps`` runs here: the model's one-call native path (CPU), one process
        (no tensor-parallel shards to drive)."""
        return (self.model.decodes_in_one_call and self.parallel is None and self.graphs is None
                and self.native_attention_available)

    @torch.inference_mode()
    def decode_steps(self, seqs, steps: int, draws) -> tuple[list[list[int]], list[list[TokenLogprob] | None]]:
        """``steps`` tokens for each of ``seqs`` (each with its one uncached token and KV blocks for
        ``steps`` positions), computed by the model's decode steps back to back in one native call,
        each step's tokens (chosen by ``draws``, a ``sampling.StepDraws``) the next one's input, and
        each sequence's log-probabilities of them where its request asks (else None); the caches
        end as ``steps`` decode steps leave them, and ``features`` holds the captured features of
        the positions computed, sequence by sequence (``decodes_in_one_call`` must hold)."""
        starts = [s.num_cached_tokens for s in seqs]
        windows = [[s.token_ids[-1]] + [0] * (steps - 1) for s in seqs]  # the later ids come from the call
        ids, pos, meta = self.prepare(seqs, starts, windows, None, self.deterministic, decode=True)
        if not meta.one_call:
            raise RuntimeError("decode_steps needs the model's one-call native path")
        batch = len(seqs)
        meta.seq_index = torch.arange(batch, dtype=torch.long, device=self.device)
        positions, slots = (t.view(batch, steps).t().contiguous() for t in (pos, meta.slot_mapping))
        first = ids.view(batch, steps)[:, 0]  # each window's first token: the sequence's uncached one
        vocab = self.model.lm_head.out_features  # alternatives past the vocabulary: none, as token_logprobs gives
        reported = [-1 if s.params.logprobs is None else min(s.params.logprobs, vocab) for s in seqs]
        tokens, features, chosen, top_ids, top_values = self.model.decode_steps(
            first, positions, self.kv_caches, meta, slots, draws, self.feature_layers,
            reported if max(reported) >= 0 else None)
        if self.feature_layers:  # step by step -> sequence by sequence, as a pass over the windows gives them
            self.features = features.view(steps, batch, -1).transpose(0, 1).reshape(steps * batch, -1)
        for seq in seqs:
            seq.num_cached_tokens += steps
        tokens = tokens.t().tolist()
        logprobs = [None] * batch
        if max(reported) >= 0:
            chosen, top_ids, top_values = (chosen.t().tolist(), top_ids.transpose(0, 1).tolist(),
                                           top_values.transpose(0, 1).tolist())
            for i, top in enumerate(reported):
                if top >= 0:
                    logprobs[i] = [TokenLogprob(t, lp, tuple(zip(ids[:top], values[:top], strict=True)))
                                   for t, lp, ids, values in zip(tokens[i], chosen[i], top_ids[i], top_values[i],
                                                                 strict=True)]
        return tokens, logprobs

    def _logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if len(rows) != hidden.shape[0]:
            hidden = hidden.index_select(0, torch.tensor(rows, dtype=torch.long, device=self.device))
        return self.model.compute_logits(hidden)

    @torch.inference_mode()
    def run_batch(self, batch: ScheduledBatch) -> torch.Tensor:
        """Compute the scheduled tokens; logits [n_sampling_seqs, V] of the sequences that sample.
        A prefill also records the prompt log-probabilities of the sequences that asked for them."""
        starts = [s.num_cached_tokens for s in batch.seqs]
        tokens = [s.token_ids[st : st + n] for s, st, n in zip(batch.seqs, starts, batch.num_new_tokens, strict=True)]
        rows, offset = [], 0
        for n, samples in zip(batch.num_new_tokens, batch.samples, strict=True):
            offset += n
            if samples:
                rows.append(offset - 1)
        decode = not batch.is_prefill
        ids, pos, meta = self.prepare(batch.seqs, starts, tokens, None, self.deterministic and decode, decode)
        if batch.is_prefill and any(s.params.prompt_logprobs is not None for s in batch.seqs):
            hidden = self._run(ids, pos, meta)
            record_prompt_logprobs(self.model.compute_logits, hidden, batch.seqs, starts, batch.num_new_tokens)
            logits = self._logits(hidden, rows)
        else:
            logits = self._logits_of(ids, pos, meta, rows, causal_step=decode)
        for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_cached_tokens += n
        return logits


def default_kv_dtype(model: LlamaForCausalLM, device: torch.device) -> torch.dtype:
    """float16 for a float32 model whose projections run the native quantised kernels on the CPU
    (its keys and values rounded to fp16 stay within the native path's documented tolerance of
    the reference, docs/benchmarks.md; attention reads half the bytes: a batch of 32 decodes about
    1.5x faster, one sequence level or faster); otherwise the model's own dtype."""
    dtype = model.embed_tokens.weight.dtype
    quantised = any(isinstance(m, QuantizedLinear) for m in model.modules())
    return torch.float16 if device.type == "cpu" and dtype == torch.float32 and quantised else dtype

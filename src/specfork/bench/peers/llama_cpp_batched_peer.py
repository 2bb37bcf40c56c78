"""llama.cpp AR with its own parallel decoding: the low-level batch API with one sequence id
per request (as its server's slots and ``llama-batched`` do), ``batch_size`` requests at a time,
greedy, same thread count; EOS ignored unless ``--no-ignore-eos`` (then a request leaves the batch
at llama.cpp's own end-of-generation tokens). llama-cpp-python's ``Llama`` class decodes one sequence
only, so this is how llama.cpp runs batched."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specfork.bench.peers.common import GenerateGroup, PeerRun
from specfork.bench.settings import BenchSettings

KINDS = ("AR",)


def llama_cpp_batched_run(kind: str, prompts: list[list[int]], s: BenchSettings) -> PeerRun:
    """llama.cpp ``kind`` (AR), ``batch_size`` sequences per batched decode (module docstring)."""
    return PeerRun(f"llama.cpp {kind}", kind, lambda: _loaded(prompts, s))


@contextmanager
def _loaded(prompts: list[list[int]], s: BenchSettings) -> Iterator[GenerateGroup]:
    import llama_cpp as lc
    import numpy as np

    from specfork.loading.resolve import resolve_checkpoint

    path = str(resolve_checkpoint(s.model).path)
    threads = s.threads or torch.get_num_threads()
    per_seq = max(len(p) for p in prompts) + s.output_len + 16
    try:  # the low-level API logs every graph it builds; keep errors only, as Llama(verbose=False) does
        from llama_cpp._logger import set_verbose

        set_verbose(False)
    except ImportError:
        pass
    lc.llama_backend_init()
    model = lc.llama_model_load_from_file(path.encode(), lc.llama_model_default_params())
    params = lc.llama_context_default_params()
    params.n_ctx = s.batch_size * per_seq
    params.n_batch = params.n_ubatch = max(per_seq, s.batch_size)
    params.n_seq_max = s.batch_size
    params.n_threads = params.n_threads_batch = threads
    ctx = lc.llama_init_from_model(model, params)
    vocab = lc.llama_model_get_vocab(model)
    n_vocab = lc.llama_vocab_n_tokens(vocab)
    batch = lc.llama_batch_init(max(per_seq, s.batch_size), 0, s.batch_size)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:  # (token, position, sequence, wants logits)
        batch.n_tokens = len(entries)
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = token, pos, 1, logits
            batch.seq_id[i][0] = seq
        if lc.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def argmax(row: int) -> int:
        return int(np.ctypeslib.as_array(lc.llama_get_logits_ith(ctx, row), shape=(n_vocab,)).argmax())

    def generate_group(group: list[list[int]], n: int) -> list[list[int]]:
        lc.llama_memory_clear(lc.llama_get_memory(ctx), True)
        outputs = []
        for seq, ids in enumerate(group):  # prefill each request into its own sequence
            decode([(t, p, seq, p == len(ids) - 1) for p, t in enumerate(ids)])
            outputs.append([argmax(len(ids) - 1)])

        def running(seq: int) -> bool:
            out = outputs[seq]
            return len(out) < n and (s.ignore_eos or not lc.llama_vocab_is_eog(vocab, out[-1]))

        while active := [seq for seq in range(len(group)) if running(seq)]:  # one batched decode per step
            decode([(outputs[seq][-1], len(group[seq]) + len(outputs[seq]) - 1, seq, True) for seq in active])
            for row, seq in enumerate(active):
                outputs[seq].append(argmax(row))
        return outputs

    try:
        yield generate_group
    finally:
        lc.llama_batch_free(batch)
        lc.llama_free(ctx)
        lc.llama_model_free(model)

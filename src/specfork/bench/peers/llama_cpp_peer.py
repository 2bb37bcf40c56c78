"""llama.cpp (llama-cpp-python) on the same GGUF, one request at a time: AR, or prompt lookup
(its Python API has no model-draft speculation). Greedy (top_k 1), or at temperature > 0 with the
bench's top-k and top-p and none of llama.cpp's own defaults (min-p 0.05, top-k 40, top-p 0.95);
llama.cpp applies the temperature after top-k and top-p, where specfork applies it first, so
top-p keeps another nucleus there (the work per token is the same). Same thread count; EOS ignored
unless ``--no-ignore-eos`` (then a request stops at llama.cpp's own end-of-generation tokens)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from specfork.bench.peers.common import GenerateGroup, PeerRun, one_at_a_time
from specfork.bench.settings import BenchSettings

KINDS = ("AR", "prompt-lookup")


def llama_cpp_missing(settings: BenchSettings) -> str | None:
    """Why llama.cpp cannot run these settings, or None."""
    import importlib.util

    from specfork.loading.resolve import CheckpointFormat, resolve_checkpoint

    if importlib.util.find_spec("llama_cpp") is None:
        return "llama-cpp-python is not installed (optional peer: pip install llama-cpp-python, builds from source)"
    if resolve_checkpoint(settings.model).format is not CheckpointFormat.GGUF:
        return f"{settings.model} is not a GGUF file"
    if settings.temperature > 0 and settings.batch_size > 1:
        return "llama.cpp's batched peer runs are greedy only"
    return None


def llama_cpp_run(kind: str, prompts: list[list[int]], s: BenchSettings) -> PeerRun:
    """llama.cpp ``kind`` (AR or prompt-lookup), one request at a time."""
    return PeerRun(f"llama.cpp {kind}", kind, lambda: _loaded(kind, prompts, s))


@contextmanager
def _loaded(kind: str, prompts: list[list[int]], s: BenchSettings) -> Iterator[GenerateGroup]:
    import llama_cpp
    from llama_cpp import Llama

    from specfork.loading.resolve import resolve_checkpoint

    path = str(resolve_checkpoint(s.model).path)
    kwargs = {}
    if kind == "prompt-lookup":
        from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

        kwargs["draft_model"] = LlamaPromptLookupDecoding(num_pred_tokens=10)
    n_ctx = max(len(p) for p in prompts) + s.output_len + 16
    threads = s.threads or torch.get_num_threads()
    llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, seed=s.seed, verbose=False,
                **kwargs)
    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    sampling = dict(top_k=1, temp=0.0) if s.temperature == 0 else dict(
        temp=s.temperature, top_k=s.top_k, top_p=s.top_p, min_p=0.0, typical_p=1.0, repeat_penalty=1.0)

    def generate(ids: list[int], n: int) -> list[int]:
        out = []
        for token in llm.generate(ids, reset=True, **sampling):
            out.append(int(token))
            if len(out) == n or (not s.ignore_eos and llama_cpp.llama_vocab_is_eog(vocab, token)):
                break
        return out

    try:
        yield one_at_a_time(generate)
    finally:
        llm.close()


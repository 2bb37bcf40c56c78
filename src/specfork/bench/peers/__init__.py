"""Peers ``specfork bench`` runs beside specfork on the same prompts, one module each:
transformers ``generate`` (AR, prompt lookup, assisted; batched AR) and llama.cpp (AR and
prompt lookup one request at a time, AR batched through its low-level API). Every peer is
timed as specfork's runs are (:mod:`specfork.bench.peers.common`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from specfork.bench.measure import RunResult
from specfork.bench.settings import BenchSettings


def run_peer(peer: str, dataset: str, prompts: list[list[int]], s: BenchSettings,
             note: Callable[[str], None]) -> Iterator[tuple[RunResult, list]]:
    """Every run of ``peer`` these settings allow, as (result, output token ids); what is
    skipped or cannot be compared goes to ``note``."""
    if peer == "llama.cpp":
        from specfork.bench.peers import llama_cpp_batched_peer, llama_cpp_peer

        reason = llama_cpp_peer.llama_cpp_missing(s)
        if reason is not None:
            note(f"skipping llama.cpp: {reason}")
            return
        if s.batch_size == 1:
            run, kinds = llama_cpp_peer.run_llama_cpp, llama_cpp_peer.KINDS
        else:
            run, kinds = llama_cpp_batched_peer.run_llama_cpp_batched, llama_cpp_batched_peer.KINDS
        for kind in kinds:
            yield run(kind, dataset, prompts, s)
        note("llama.cpp: llama-cpp-python has no draft-model speculation API; AR and prompt lookup only")
        return
    from specfork.bench.peers import transformers_peer

    if s.batch_size != 1:
        note("transformers: batched runs are AR only (prompt lookup and assisted generation take one sequence)")
    for kind in transformers_peer.KINDS if s.batch_size == 1 else transformers_peer.BATCHED_KINDS:
        yield transformers_peer.run_transformers(kind, dataset, prompts, s)

"""Peers ``specfork bench`` runs beside specfork on the same prompts, one module each:
transformers ``generate`` (AR, prompt lookup, assisted; batched AR) and llama.cpp (AR and
prompt lookup one request at a time, AR batched through its low-level API). Every peer is
timed as specfork's runs are, interleaved with them where they run together
(:mod:`specfork.bench.peers.common`)."""

from __future__ import annotations

from collections.abc import Callable

from specfork.bench.peers.common import PeerRun
from specfork.bench.settings import BenchSettings


def peer_runs(peer: str, prompts: list[list[int]], s: BenchSettings, note: Callable[[str], None]) -> list[PeerRun]:
    """Every run of ``peer`` these settings allow; what is skipped or cannot be compared goes to
    ``note``."""
    if peer == "llama.cpp":
        from specfork.bench.peers import llama_cpp_batched_peer, llama_cpp_peer

        reason = llama_cpp_peer.llama_cpp_missing(s)
        if reason is not None:
            note(f"skipping llama.cpp: {reason}")
            return []
        note("llama.cpp: llama-cpp-python has no draft-model speculation API; AR and prompt lookup only")
        if s.batch_size == 1:
            return [llama_cpp_peer.llama_cpp_run(kind, prompts, s) for kind in llama_cpp_peer.KINDS]
        return [llama_cpp_batched_peer.llama_cpp_batched_run(kind, prompts, s) for kind in llama_cpp_batched_peer.KINDS]
    from specfork.bench.peers import transformers_peer

    if s.batch_size != 1:
        note("transformers: batched runs are AR only (prompt lookup and assisted generation take one sequence)")
    return [transformers_peer.transformers_run(kind, s)
            for kind in (transformers_peer.KINDS if s.batch_size == 1 else transformers_peer.BATCHED_KINDS)]

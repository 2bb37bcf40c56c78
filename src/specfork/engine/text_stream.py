"""Incremental text of one sequence: what can be shown now without ever taking it back."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from specfork.engine.llm_engine import LLMEngine
    from specfork.engine.sequence import Sequence


class TextStream:
    """Yields the decoded output of ``seq`` piece by piece. While the sequence runs it holds back a
    trailing incomplete UTF-8 character and any tail that could still become a stop string, so the
    concatenated pieces always equal the final visible text."""

    def __init__(self, engine: LLMEngine, seq: Sequence) -> None:
        self.engine = engine
        self.seq = seq
        self.shown = ""

    def next_piece(self) -> str:
        text = self.engine.visible_text(self.seq)
        if not self.seq.is_finished:
            text = text.rstrip("\ufffd")
            stops = self.seq.params.stop
            if stops:
                text = text[: max(0, len(text) - max(len(s) for s in stops) + 1)]
        if len(text) > len(self.shown) and text.startswith(self.shown):
            piece, self.shown = text[len(self.shown) :], text
            return piece
        return ""

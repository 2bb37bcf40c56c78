"""One request's state as it moves through the engine."""

from __future__ import annotations

import time
from enum import Enum

import torch

from specfork.outputs import TokenLogprob
from specfork.sampling import TokenHistory
from specfork.sampling_params import SamplingParams


class SequenceStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Token ids (prompt then output), KV-cache bookkeeping and timing of one request.

    ``num_cached_tokens`` counts the leading tokens whose keys/values are in the KV cache.
    After preemption it drops to 0 and the sequence is recomputed from its tokens.
    """

    def __init__(
        self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, generator: torch.Generator,
        stop_ids: frozenset[int] = frozenset(), bad_words: tuple[tuple[int, ...], ...] = (), grammar=None,
    ) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.params = params
        self.stop_ids = stop_ids  # the tokens that end the output: EOS unless ignored, and the stop token ids
        self.bad_words = bad_words  # token sequences never to complete (the request's bad words)
        self.grammar = grammar  # the output's matcher (structured outputs), or None
        self.generator = generator
        self.status = SequenceStatus.WAITING
        self.block_table: list[int] = []
        self.block_keys: list[bytes] = []  # prefix-cache keys of the leading full, computed blocks
        self.num_cached_tokens = 0
        self.num_prompt_tokens_reused = 0  # prompt tokens the prefix cache held at admission
        self.finish_reason: str | None = None
        self.num_preemptions = 0
        # Log-probabilities of the output tokens / of prompt tokens 1.. (None unless requested).
        self.logprobs: list[TokenLogprob] | None = [] if params.logprobs is not None else None
        self.prompt_logprobs: list[TokenLogprob] | None = None
        # Step-specific counters (e.g. speculation); values with ``as_metrics()`` reach the output.
        self.stats: dict = {}
        self.arrival_time = time.perf_counter()
        self.first_token_time: float | None = None
        self.finish_time: float | None = None

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    def history(self, drafts: list[int] | tuple[int, ...] = ()) -> TokenHistory:
        """What the request's logit adjustments read for its next token (and, with ``drafts``, for
        the tokens after each of them: a verify window)."""
        return TokenHistory(self.params, self.token_ids, self.num_prompt_tokens, self.stop_ids, drafts, self.bad_words,
                            self.grammar)

    @property
    def num_uncached_tokens(self) -> int:
        return len(self.token_ids) - self.num_cached_tokens

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

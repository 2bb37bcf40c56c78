"""The public Python API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Sequence

from specfork.config import DEFAULT_MODEL, Config
from specfork.engine.llm_engine import LLMEngine, StepUpdate
from specfork.engine.step import StepHealth
from specfork.engine.text_stream import TextStream
from specfork.errors import PromptError, SpecforkError
from specfork.outputs import RequestOutput
from specfork.sampling_params import SamplingParams

Prompt = str | list[int]

_CONFIG_FIELDS = {f.name for f in dataclasses.fields(Config)}


class LLM:
    """An engine plus the conveniences of batch generation and chat.

    Keyword arguments are the fields of :class:`specfork.config.Config`.
    """

    def __init__(self, model: str = DEFAULT_MODEL, **options) -> None:
        unknown = sorted(set(options) - _CONFIG_FIELDS)
        if unknown:
            raise SpecforkError(f"unknown option(s) {', '.join(unknown)}; valid: {', '.join(sorted(_CONFIG_FIELDS))}")
        self.config = Config(model=model, **options)
        build_step, extra_roles, drafter = None, (), None
        if self.config.mode == "sd":
            from specfork.speculative.factory import build_speculative_step

            build_step = build_speculative_step
        elif self.config.mode == "ssd":
            from functools import partial

            from specfork.speculative.factory import build_ssd_step
            from specfork.speculative.ssd.transport import DrafterProcess

            if self.config.drafter_rank is not None:  # a rank of the world the engine starts
                from specfork.parallel.world import RankRole
                from specfork.speculative.ssd.worker import DRAFTER_ROLE

                extra_roles = (RankRole(DRAFTER_ROLE),)
            else:
                # The drafter's interpreter starts now and imports torch while the target loads;
                # it is told what to load once the target is ready.
                drafter = DrafterProcess()
            build_step = partial(build_ssd_step, drafter=drafter)
        try:
            self.engine = LLMEngine(self.config, build_step, extra_roles)
        except BaseException:
            if drafter is not None:
                drafter.close()
            raise
        self.closed = False

    def close(self) -> None:
        """Stop helper processes (the SSD drafter, tensor-parallel ranks); generating afterwards is
        an error. Also done at interpreter exit."""
        self.closed = True
        self.engine.close()

    def _open_engine(self) -> LLMEngine:
        if self.closed:
            raise SpecforkError("this LLM is closed (close() or the end of its `with` block); create a new one")
        return self.engine

    def health(self) -> StepHealth:
        """Whether decoding runs as configured (an SSD drafter that failed: ``degraded``)."""
        return self.engine.health()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def vocab_size(self) -> int:
        """The target's vocabulary: valid token ids are 0 .. vocab_size - 1."""
        return self.engine.loaded.arch.vocab_size

    @property
    def max_model_len(self) -> int:
        """The longest prompt + output a request may have."""
        return self.engine.max_model_len

    @property
    def auto_k_choice(self) -> str | None:
        """With ``k="auto"``: the k chosen, the acceptance and the expected gain, in one phrase
        (the measured step costs behind it are logged at INFO); None otherwise."""
        auto_k = getattr(self.engine.step_strategy, "auto_k", None)
        return auto_k.summary() if auto_k is not None else None

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` (text, tokenized as the tokenizer says, or ids, checked)."""
        return self.engine.encode_prompt(prompt)

    def encode_chat(self, messages: list[dict], *, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, chat_template_kwargs: dict | None = None) -> list[int]:
        """Token ids of a conversation rendered with the model's chat template: with the assistant's
        turn opened (``add_generation_prompt``), or with the last message left open so that the reply
        continues it (``continue_final_message``; then ``add_generation_prompt=False``);
        ``chat_template_kwargs`` are further template variables (as vLLM's)."""
        return self.engine.encode_chat(messages, add_generation_prompt=add_generation_prompt,
                                       continue_final_message=continue_final_message,
                                       template_kwargs=chat_template_kwargs)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Generate for every prompt (raw text, tokenized as the tokenizer says, or token ids).
        Outputs come back in input order."""
        batch = _as_prompt_list(prompts)
        self._open_engine()
        return self._run([self.encode(p) for p in batch], sampling_params, use_tqdm)

    def chat(
        self,
        conversations: list[dict] | Sequence[list[dict]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict | None = None,
    ) -> list[RequestOutput]:
        """Generate a reply for each conversation (a list of {role, content} messages); the last three
        options are ``encode_chat``'s."""
        if isinstance(conversations, list) and conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if not conversations:
            raise PromptError("no conversations given")
        self._open_engine()
        template = {"add_generation_prompt": add_generation_prompt, "continue_final_message": continue_final_message,
                    "chat_template_kwargs": chat_template_kwargs}
        return self._run([self.encode_chat(c, **template) for c in conversations], sampling_params, use_tqdm)

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[str]:
        """Generate for one prompt (text or token ids, as ``generate`` takes it), yielding text as
        it becomes final. The finished output is available as ``self.last_output`` afterwards."""
        engine = self._open_engine()
        ids = self.encode(prompt)
        (params,) = _as_params_list(params, 1)
        seq = engine.add_request(ids, params)
        text = TextStream(engine, seq)
        try:
            while True:
                # Another stream's step may have finished this sequence: its held-back tail is
                # still to be shown, once.
                finished = seq.is_finished
                if not finished:
                    _raise_errors(engine.step())
                piece = text.next_piece()
                if piece:
                    yield piece
                if finished:
                    break
        finally:
            engine.abort(seq)
        self.last_output = engine.output(seq)

    def _run(self, prompt_ids: list[list[int]], sampling_params, use_tqdm: bool) -> list[RequestOutput]:
        """(``generate`` and ``chat`` refused a closed LLM before encoding.)"""
        params = _as_params_list(sampling_params, len(prompt_ids))
        engine = self.engine
        for ids, p in zip(prompt_ids, params, strict=True):  # refuse the batch before queueing any of it
            engine.check_prompt_ids(ids)
            engine.check_length(len(ids), p.max_tokens)
            if p.structured_outputs is not None:
                engine.grammars.check(p.structured_outputs)
        seqs = [engine.add_request(ids, p) for ids, p in zip(prompt_ids, params, strict=True)]
        progress = None
        if use_tqdm:
            from tqdm import tqdm

            progress = tqdm(total=len(seqs), desc="generating", unit="req")
        # A set of the unfinished, not a scan of every sequence per step (quadratic in big batches).
        unfinished = {s.seq_id: s for s in seqs if not s.is_finished}
        try:
            while unfinished:
                updates = _raise_errors(engine.step())
                done = [u.seq for u in updates if u.finished] if updates else list(unfinished.values())
                for seq in done:
                    if seq.is_finished and unfinished.pop(seq.seq_id, None) is not None and progress is not None:
                        progress.update(1)
        finally:
            for s in seqs:
                engine.abort(s)
            if progress is not None:
                progress.close()
        return [engine.output(s) for s in seqs]


def _raise_errors(updates: list[StepUpdate]) -> list[StepUpdate]:
    """Offline, a request the engine failed is an error for the caller (the server, instead,
    fails that request alone)."""
    for update in updates:
        if update.error is not None:
            raise RuntimeError(f"generation failed: {update.error} (the log has the cause)")
    return updates


def _as_prompt_list(prompts) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if not prompts:
            raise PromptError("no prompts given")
        if all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        return list(prompts)
    raise PromptError(f"prompts must be a string, a list of token ids, or a list of those; got {type(prompts).__name__}")


def _as_params_list(sampling_params, n: int) -> list[SamplingParams]:
    if sampling_params is None:
        return [SamplingParams()] * n
    if isinstance(sampling_params, SamplingParams):
        return [sampling_params] * n
    params = list(sampling_params)
    if len(params) != n or not all(isinstance(p, SamplingParams) for p in params):
        raise SpecforkError(f"expected one SamplingParams or a list of {n}, got {sampling_params!r}")
    return params

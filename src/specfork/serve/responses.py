"""OpenAI response bodies and stream chunks built from engine outputs: choices, usage and
log-probabilities in the completions and chat formats."""

from __future__ import annotations

import codecs
import dataclasses
from collections.abc import Sequence

from specfork.outputs import RequestOutput, TokenLogprob
from specfork.serve.preprocess import Job


class TokenNames:
    """Token ids as the strings clients see (``token_id:N`` for a model without a tokenizer)."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def __call__(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def bytes_of(self, token_id: int) -> bytes:
        """The token's own bytes (part of a character for some tokens; see Tokenizer.token_bytes)."""
        if self.tokenizer is None:
            return self(token_id).encode("utf-8")
        return self.tokenizer.token_bytes(token_id)


class TextCursor:
    """Where the next token starts in a choice's text, in characters: its tokens' bytes decoded as
    they come, so a character split over tokens counts once, when it is complete (the offset of a
    token that starts inside a character is that character's)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self.position = 0

    def advance(self, token_bytes: bytes) -> None:
        self.position += len(self._decoder.decode(token_bytes))


def completion_logprobs(names: TokenNames, entries: Sequence[TokenLogprob | None], cursor: TextCursor) -> dict:
    """The completions API's ``logprobs`` object; ``text_offset`` from ``cursor``, which moves past
    the tokens. An entry of None (the first prompt token under ``echo``) has no log-probability.
    ``top_logprobs`` holds the alternatives plus the chosen token."""
    tokens, token_logprobs, top, offsets = [], [], [], []
    for entry, token_id in entries:
        name = names(token_id)
        tokens.append(name)
        offsets.append(cursor.position)
        cursor.advance(names.bytes_of(token_id))
        if entry is None:
            token_logprobs.append(None)
            top.append(None)
            continue
        token_logprobs.append(entry.logprob)
        alternatives = {names(t): lp for t, lp in entry.top}
        alternatives.setdefault(name, entry.logprob)
        top.append(alternatives)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


def chat_logprobs(names: TokenNames, entries: Sequence[TokenLogprob]) -> dict:
    """The chat API's ``logprobs`` object: one item per token with its top alternatives."""

    def item(token_id: int, logprob: float) -> dict:
        name = names(token_id)
        return {"token": name, "logprob": logprob, "bytes": list(names.bytes_of(token_id))}

    content = [{**item(e.token_id, e.logprob), "top_logprobs": [item(t, lp) for t, lp in e.top]} for e in entries]
    return {"content": content, "refusal": None}


def output_logprobs(names: TokenNames, job: Job, choice: int, entries: Sequence[TokenLogprob] | None,
                    prompt: Sequence[TokenLogprob] | None = None, cursor: TextCursor | None = None) -> dict | None:
    """The ``logprobs`` of one choice (or of one stream chunk, ``cursor`` going on from the
    choice's earlier chunks); None when not asked for."""
    if entries is None:
        return None
    if job.chat:
        return chat_logprobs(names, entries)
    pairs = [(e, e.token_id) for e in entries]
    if prompt is not None:
        first = job.prompts[job.prompt_of(choice)][0]
        pairs = [(None, first)] + [(e, e.token_id) for e in prompt] + pairs
    return completion_logprobs(names, pairs, cursor or TextCursor())


def shown(job: Job, output: RequestOutput) -> RequestOutput:
    """``output`` as the client sees it: when the request only scores its prompt (echo with
    max_tokens 0) the token generated alongside is left out and the choice ended by its length
    (as vLLM answers), unless it was aborted or failed."""
    if not job.scores_only:
        return output
    reason = output.finish_reason if output.finish_reason in ("abort", "error") else "length"
    return dataclasses.replace(output, token_ids=[], text="", finish_reason=reason,
                               logprobs=None if output.logprobs is None else [])


def usage(job: Job, outputs: Sequence[RequestOutput]) -> dict:
    """The response's usage: each prompt counted once, its cached tokens (those the prefix cache
    held, as its first choice found them) in ``prompt_tokens_details``, as OpenAI reports them."""
    n = job.body.n
    cached = sum(outputs[i].metrics.get("num_cached_prompt_tokens", 0) for i in range(0, len(outputs), n))
    return {**usage_of(job.num_prompt_tokens, sum(len(o.token_ids) for o in outputs)),
            "prompt_tokens_details": {"cached_tokens": cached}}


def usage_of(prompt_len: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_len, "completion_tokens": completion_tokens,
            "total_tokens": prompt_len + completion_tokens}


def response_body(job: Job, rid: str, created: int, model: str, outputs: list[RequestOutput],
                  names: TokenNames) -> dict:
    """The whole (non-streamed) response, one choice per output in index order."""
    choices = []
    outputs = [shown(job, o) for o in outputs]
    for index, output in enumerate(outputs):
        extra = {"token_ids": list(output.token_ids)} if job.body.return_token_ids else {}
        if job.chat:
            choice = {"index": index, "message": {"role": "assistant", "content": output.text}}
        else:
            choice = {"index": index, "text": (job.echo_text(index) or "") + output.text}
        prompt = output.prompt_logprobs if job.echo_texts is not None else None
        choice["logprobs"] = output_logprobs(names, job, index, output.logprobs, prompt)
        choices.append({**choice, "finish_reason": output.finish_reason, **extra})
    kind = "chat.completion" if job.chat else "text_completion"
    return {"id": rid, "object": kind, "created": created, "model": model, "choices": choices,
            "usage": usage(job, outputs)}


class ChunkMaker:
    """Stream chunks of one response: ``text_completion`` chunks carrying ``text``, or
    ``chat.completion.chunk`` chunks carrying a ``delta``."""

    def __init__(self, job: Job, rid: str, created: int, model: str, names: TokenNames) -> None:
        self.job, self.names = job, names
        self.cursors = [TextCursor() for _ in job.params]  # completions: each choice's text offset
        self.head = {"id": rid, "object": "chat.completion.chunk" if job.chat else "text_completion",
                     "created": created, "model": model}

    def opening(self, index: int) -> dict | None:
        """The first chunk of a choice: the assistant role (chat) or the echoed prompt."""
        if self.job.chat:
            return self.choice(index, "", role="assistant")
        return None

    def echo(self, index: int, prompt_logprobs: Sequence[TokenLogprob] | None) -> dict:
        logprobs = None
        if self.job.body.logprobs is not None:
            logprobs = output_logprobs(self.names, self.job, index, [], prompt_logprobs or [], self.cursors[index])
        return self.choice(index, self.job.echo_text(index) or "", logprobs=logprobs)

    def choice(self, index: int, text: str | None, *, finish_reason: str | None = None,
               token_ids: list[int] | None = None, logprobs: dict | None = None, role: str | None = None) -> dict:
        if self.job.chat:
            delta = {} if text is None else {"content": text}
            if role is not None:
                delta = {"role": role, **delta}
            content = {"delta": delta}
        else:
            content = {"text": text or ""}
        extra = {"token_ids": list(token_ids or [])} if self.job.body.return_token_ids else {}
        return {**self.head, "choices": [{"index": index, **content, "logprobs": logprobs,
                                          "finish_reason": finish_reason, **extra}]}

    def piece(self, index: int, text: str, token_ids: list[int], logprobs: Sequence[TokenLogprob] | None) -> dict:
        formatted = output_logprobs(self.names, self.job, index, logprobs, cursor=self.cursors[index])
        return self.choice(index, text, token_ids=token_ids, logprobs=formatted)

    def usage(self, outputs: Sequence[RequestOutput]) -> dict:
        return {**self.head, "choices": [], "usage": usage(self.job, outputs)}

    def with_usage_so_far(self, chunk: dict, index: int, completion_tokens: int) -> dict:
        """``chunk`` of choice ``index`` with that choice's usage up to it: its prompt's tokens and
        the tokens it generated so far (vLLM's continuous_usage_stats)."""
        prompt = len(self.job.prompts[self.job.prompt_of(index)])
        return {**chunk, "usage": usage_of(prompt, completion_tokens)}

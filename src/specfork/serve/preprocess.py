"""From a request body to what the engine runs: decode the JSON, validate it, apply the chat
template, tokenize and build one ``SamplingParams`` per choice.

All of it is CPU work proportional to the body, so the app runs it on a worker thread, never on
the event loop (a large body must not stall /health or running streams).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from specfork.engine.llm_engine import LLMEngine
from specfork.errors import SpecforkError
from specfork.sampling_params import SamplingParams, choice_seed
from specfork.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    parse_request,
)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # as the OpenAI completions API


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request: its body, its prompts' tokens (several for a batch of completion
    prompts) and the sampling settings of each choice, ``n`` per prompt in prompt order."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    params: list[SamplingParams]
    echo_texts: list[str] | None = None  # completions with echo: each prompt's text

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)

    def prompt_of(self, choice: int) -> int:
        """The prompt behind choice ``choice`` (choices are numbered across prompts, as vLLM does)."""
        return choice // self.body.n

    @property
    def scores_only(self) -> bool:
        """Completions with echo and max_tokens 0: the engine generates one token to reach the
        prompt's log-probabilities, and the responses leave it out."""
        return not self.chat and self.body.scores_only

    def echo_text(self, choice: int) -> str | None:
        return None if self.echo_texts is None else self.echo_texts[self.prompt_of(choice)]

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(ids) for ids in self.prompts)


def decode_json(raw: bytes) -> object:
    try:
        return json.loads(raw)
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def prepare_completion(raw: bytes, engine: LLMEngine, served_model_name: str) -> Job:
    body = parse_request(CompletionRequest, decode_json(raw))
    _check_model(body.model, served_model_name)
    prompts, params, echo_texts = [], [], [] if body.echo else None
    for index, prompt in enumerate(body.prompts):
        where = "prompt" if len(body.prompts) == 1 else f"prompt.{index}"
        try:
            ids = engine.encode_prompt(prompt)
        except SpecforkError as e:
            raise ApiError(400, str(e) if where == "prompt" else f"{where}: {e}", param=where) from None
        if echo_texts is not None:
            if isinstance(prompt, str):
                echo_texts.append(prompt)
            else:
                echo_texts.append(engine.tokenizer.decode(ids) if engine.tokenizer is not None else "")
        max_tokens = body.max_tokens
        if max_tokens is None:
            max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, engine.max_model_len - len(ids))
        elif body.scores_only:  # (encode_prompt leaves a position after the prompt)
            max_tokens = 1  # the prompt's log-probabilities come with the first token, which is not returned
        prompt_logprobs = body.logprobs if body.echo else None
        prompts.append(ids)
        params += _sampling_params(body, max_tokens, body.top_logprobs_wanted, prompt_logprobs)
    _check_grammar(body, params[0], engine)
    return Job(body, prompts, params, echo_texts)


def prepare_chat(raw: bytes, engine: LLMEngine, served_model_name: str) -> Job:
    body = parse_request(ChatCompletionRequest, decode_json(raw))
    _check_model(body.model, served_model_name)
    try:
        prompt_ids = _render_conversation(body, engine.encode_chat)
    except SpecforkError as e:
        raise ApiError(400, str(e), param="messages") from None
    max_tokens = body.token_limit
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = engine.max_model_len - len(prompt_ids)
    params = _sampling_params(body, max_tokens, body.top_logprobs_wanted, None)
    _check_grammar(body, params[0], engine)
    return Job(body, [prompt_ids], params)


def _check_grammar(body: CompletionRequest | ChatCompletionRequest, params: SamplingParams, engine: LLMEngine) -> None:
    """A structured output compiled here, off the engine's thread (the first one also builds the
    tokenizer's table for llguidance, ~0.4 s): a grammar that does not compile is a 400 before
    the request is queued. (The engine then gives each choice a copy of the compiled matcher.)"""
    if params.structured_outputs is None:
        return
    try:
        engine.grammars.check(params.structured_outputs)
    except SpecforkError as e:
        raise ApiError(400, str(e), param=body.field_of(e.param)) from None


def _render_conversation(body: ChatCompletionRequest | TokenizeRequest, render) -> list[int]:
    """The request's messages through ``render`` (the engine's ``encode_chat``, or the tokenizer's
    ``apply_chat_template``), with its template options."""
    return render([m.as_template_message() for m in body.messages], add_generation_prompt=body.add_generation_prompt,
                  continue_final_message=body.continue_final_message, template_kwargs=body.chat_template_kwargs)


def tokenize(raw: bytes, engine: LLMEngine, served_model_name: str) -> dict:
    """/tokenize's reply: the ids a completion or chat request would run on (not checked against
    the context: the count tells whether it fits)."""
    body = parse_request(TokenizeRequest, decode_json(raw))
    _check_model(body.model, served_model_name)
    if engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="prompt")
    try:
        if body.prompt is not None:
            if not body.prompt:
                raise ApiError(400, "prompt is empty", param="prompt")
            ids = engine.tokenizer.encode(body.prompt)
        else:
            ids = _render_conversation(body, engine.tokenizer.apply_chat_template)  # no context check here
    except SpecforkError as e:
        raise ApiError(400, str(e), param="prompt" if body.prompt is not None else "messages") from None
    return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids}


def detokenize(raw: bytes, engine: LLMEngine, served_model_name: str) -> dict:
    body = parse_request(DetokenizeRequest, decode_json(raw))
    _check_model(body.model, served_model_name)
    if engine.tokenizer is None:
        raise ApiError(400, "this model has no tokenizer", param="tokens")
    try:
        engine.check_vocabulary(body.tokens)
    except SpecforkError as e:
        raise ApiError(400, str(e), param="tokens") from None
    return {"prompt": engine.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(400, f"the model {name!r} does not exist; this server serves {served!r}",
                       param="model", code="model_not_found")


def _sampling_params(body: CompletionRequest | ChatCompletionRequest, max_tokens: int, logprobs: int | None,
                     prompt_logprobs: int | None) -> list[SamplingParams]:
    """One per choice; with a seed, choice i draws with ``choice_seed(seed, i)``. Whether the
    prompt and max_tokens fit the context is the engine's rule, checked when it adds the request."""
    try:
        first = SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, min_p=body.min_p,
            repetition_penalty=body.repetition_penalty, presence_penalty=body.presence_penalty,
            frequency_penalty=body.frequency_penalty, max_tokens=max_tokens, min_tokens=body.min_tokens,
            logit_bias=body.logit_bias,
            allowed_token_ids=None if body.allowed_token_ids is None else tuple(body.allowed_token_ids),
            bad_words=tuple(body.bad_words or ()),
            seed=body.seed, stop=body.stops, stop_token_ids=tuple(body.stop_token_ids or ()),
            include_stop_str_in_output=body.include_stop_str_in_output, skip_special_tokens=body.skip_special_tokens,
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=body.structured_output(),
        )
    except SpecforkError as e:
        raise ApiError(400, str(e), param=body.field_of(e.param)) from None
    if first.seed is None:
        return [first] * body.n
    return [first] + [dataclasses.replace(first, seed=choice_seed(first.seed, i)) for i in range(1, body.n)]

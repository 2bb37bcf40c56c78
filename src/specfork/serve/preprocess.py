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
from specfork.serve.protocol import ApiError, ChatCompletionRequest, CompletionRequest, parse_request

DEFAULT_COMPLETION_MAX_TOKENS = 16  # as the OpenAI completions API


@dataclass(frozen=True, slots=True)
class Job:
    """A validated request: its body, prompt tokens and the sampling settings of each choice."""

    body: CompletionRequest | ChatCompletionRequest
    prompt_ids: list[int]
    params: list[SamplingParams]
    echo_text: str | None = None  # completions with echo: the prompt's text

    @property
    def chat(self) -> bool:
        return isinstance(self.body, ChatCompletionRequest)


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
    try:
        prompt_ids = engine.encode_prompt(body.prompt)
    except SpecforkError as e:
        raise ApiError(400, str(e), param="prompt") from None
    echo_text = None
    if body.echo:
        if isinstance(body.prompt, str):
            echo_text = body.prompt
        else:
            echo_text = engine.tokenizer.decode(prompt_ids) if engine.tokenizer is not None else ""
    max_tokens = body.max_tokens
    if max_tokens is None:
        max_tokens = min(DEFAULT_COMPLETION_MAX_TOKENS, engine.max_model_len - len(prompt_ids))
    prompt_logprobs = body.logprobs if body.echo else None
    params = _sampling_params(body, max_tokens, body.top_logprobs_wanted, prompt_logprobs)
    return Job(body, prompt_ids, params, echo_text)


def prepare_chat(raw: bytes, engine: LLMEngine, served_model_name: str) -> Job:
    body = parse_request(ChatCompletionRequest, decode_json(raw))
    _check_model(body.model, served_model_name)
    try:
        prompt_ids = engine.encode_chat([m.as_template_message() for m in body.messages],
                                        add_generation_prompt=body.add_generation_prompt,
                                        continue_final_message=body.continue_final_message)
    except SpecforkError as e:
        raise ApiError(400, str(e), param="messages") from None
    max_tokens = body.token_limit
    if max_tokens is None:  # as OpenAI: up to the end of the context
        max_tokens = engine.max_model_len - len(prompt_ids)
    return Job(body, prompt_ids, _sampling_params(body, max_tokens, body.top_logprobs_wanted, None))


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
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
            seed=body.seed, stop=body.stops, stop_token_ids=tuple(body.stop_token_ids or ()),
            ignore_eos=body.ignore_eos, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
    except SpecforkError as e:
        raise ApiError(400, str(e), param=body.field_of(e.param)) from None
    if first.seed is None:
        return [first] * body.n
    return [first] + [dataclasses.replace(first, seed=choice_seed(first.seed, i)) for i in range(1, body.n)]

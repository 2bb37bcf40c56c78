"""The OpenAI-compatible HTTP API over one shared :class:`EngineLoop`.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (streaming with SSE and
``data: [DONE]``, or not), GET /health, GET /metrics (Prometheus text).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from specfork.errors import SpecforkError
from specfork.outputs import RequestOutput
from specfork.sampling_params import SamplingParams
from specfork.serve.engine_loop import (
    EngineLoop,
    EngineStopped,
    Failed,
    Finished,
    Piece,
    QueueFull,
    RequestHandle,
)
from specfork.serve.metrics import ServerMetrics
from specfork.serve.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    GenerationRequest,
    parse_request,
)

logger = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # as the OpenAI completions API
DISCONNECT_POLL_S = 0.5


def build_app(loop: EngineLoop, metrics: ServerMetrics, served_model_name: str) -> FastAPI:
    """``loop`` must be started; the app shuts it down when the server stops."""
    llm = loop.llm
    engine = llm.engine
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # uvicorn has stopped taking requests and waited for open ones (its graceful timeout);
        # what is still running is cancelled and the engine (and any drafter process) stops.
        await asyncio.to_thread(loop.shutdown)

    app = FastAPI(title="specfork", lifespan=lifespan, docs_url=None, redoc_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        metrics.request_failed(error.status)
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        metrics.request_failed(500)
        return JSONResponse(
            ApiError(500, f"internal error: {type(error).__name__}: {error}", kind="server_error").body(),
            status_code=500,
        )

    @app.get("/health")
    async def health() -> JSONResponse:
        if not loop.alive:
            return JSONResponse({"status": "stopping"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(loop.snapshot, loop.num_active),
                                 media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [{
            "id": served_model_name, "object": "model", "created": created, "owned_by": "specfork",
            "max_model_len": engine.max_model_len, "vocab_size": engine.loaded.arch.vocab_size,
        }]})

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = parse_request(CompletionRequest, await _json_body(request))
        _check_model(body.model, served_model_name)
        try:
            prompt_ids = engine.encode_prompt(body.prompt)
        except SpecforkError as e:
            raise ApiError(400, str(e), param="prompt") from None
        params = _sampling_params(body, body.max_tokens, len(prompt_ids), engine.max_model_len,
                                  DEFAULT_COMPLETION_MAX_TOKENS, "max_tokens")
        handle = _submit(loop, prompt_ids, params)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_chunks(loop, handle, rid, served_model_name, body, len(prompt_ids), chat=False))
        output = await _wait(loop, handle, request)
        return {
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": served_model_name,
            "choices": [{"index": 0, "text": output.text, "logprobs": None, "finish_reason": output.finish_reason,
                         **_token_ids(body, output.token_ids)}],
            "usage": _usage(len(prompt_ids), output),
        }

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        body = parse_request(ChatCompletionRequest, await _json_body(request))
        _check_model(body.model, served_model_name)
        try:
            prompt_ids = engine.encode_chat([m.as_template_message() for m in body.messages])
        except SpecforkError as e:
            raise ApiError(400, str(e), param="messages") from None
        limit_name = "max_completion_tokens" if body.max_completion_tokens is not None else "max_tokens"
        params = _sampling_params(body, body.token_limit, len(prompt_ids), engine.max_model_len, None, limit_name)
        handle = _submit(loop, prompt_ids, params)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            return _sse(_stream_chunks(loop, handle, rid, served_model_name, body, len(prompt_ids), chat=True))
        output = await _wait(loop, handle, request)
        return {
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": served_model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": output.text},
                         "logprobs": None, "finish_reason": output.finish_reason,
                         **_token_ids(body, output.token_ids)}],
            "usage": _usage(len(prompt_ids), output),
        }

    return app


# ---- request handling -----------------------------------------------------------------------------


async def _json_body(request: Request) -> object:
    raw = await request.body()
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from None


def _check_model(name: str, served: str) -> None:
    if name != served:
        raise ApiError(400, f"the model '{name}' does not exist; this server serves '{served}'",
                       param="model", code="model_not_found")


def _sampling_params(body: GenerationRequest, max_tokens: int | None, prompt_len: int, max_model_len: int,
                     default: int | None, limit_name: str) -> SamplingParams:
    room = max_model_len - prompt_len
    if max_tokens is not None and max_tokens > room:
        raise ApiError(
            400,
            f"this model's maximum context length is {max_model_len} tokens; the prompt has {prompt_len} "
            f"and {limit_name} asks for {max_tokens} more ({prompt_len + max_tokens} in all)",
            param=limit_name,
        )
    if max_tokens is None:
        max_tokens = room if default is None else min(default, room)
    try:
        return SamplingParams(
            temperature=body.temperature, top_p=body.top_p, top_k=body.top_k, max_tokens=max_tokens,
            seed=body.seed, stop=body.stops, ignore_eos=body.ignore_eos,
        )
    except SpecforkError as e:
        raise ApiError(400, str(e)) from None


def _submit(loop: EngineLoop, prompt_ids: list[int], params: SamplingParams) -> RequestHandle:
    try:
        return loop.submit(prompt_ids, params)
    except QueueFull as e:
        raise ApiError(503, str(e), kind="server_overloaded", code="queue_full") from None
    except EngineStopped as e:
        raise ApiError(503, str(e), kind="server_error", code="shutting_down") from None


async def _wait(loop: EngineLoop, handle: RequestHandle, request: Request) -> RequestOutput:
    """The finished output; cancels the request if the client disconnects first."""
    try:
        while True:
            try:
                event = await asyncio.wait_for(handle.events.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await request.is_disconnected():
                    raise ApiError(499, "the client disconnected") from None
                continue
            if isinstance(event, Finished):
                return event.output
            if isinstance(event, Failed):
                raise ApiError(500, event.message, kind="server_error")
    finally:
        loop.abort(handle)


def _token_ids(body: GenerationRequest, token_ids: list[int]) -> dict:
    return {"token_ids": list(token_ids)} if body.return_token_ids else {}


def _usage(prompt_len: int, output: RequestOutput) -> dict:
    n = len(output.token_ids)
    return {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def encode() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def _events(loop: EngineLoop, handle: RequestHandle) -> AsyncIterator[Piece | Finished | Failed]:
    """The request's events up to the last; the request is cancelled if the consumer stops early
    (a client that disconnects mid-stream)."""
    try:
        while True:
            event = await handle.events.get()
            yield event
            if not isinstance(event, Piece):
                return
    finally:
        loop.abort(handle)


def _error_chunk(event: Failed) -> dict:
    return ApiError(500, event.message, kind="server_error").body()


async def _stream_chunks(loop: EngineLoop, handle: RequestHandle, rid: str, model: str,
                         body: GenerationRequest, prompt_len: int, *, chat: bool) -> AsyncIterator[dict]:
    """SSE payloads of one request: ``text_completion`` chunks carrying ``text``, or (chat)
    ``chat.completion.chunk`` chunks carrying a ``delta``, opened by the assistant role."""
    created = int(time.time())
    kind = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish_reason: str | None, token_ids: list[int] | None = None) -> dict:
        if chat:
            content = {"delta": {} if text is None else {"content": text}}
        else:
            content = {"text": text or ""}
        return {"id": rid, "object": kind, "created": created, "model": model,
                "choices": [{"index": 0, **content, "logprobs": None, "finish_reason": finish_reason,
                             **_token_ids(body, token_ids or [])}]}

    if chat:
        opening = chunk("", None)
        opening["choices"][0]["delta"]["role"] = "assistant"
        yield opening
    async for event in _events(loop, handle):
        if isinstance(event, Piece):
            if event.text or body.return_token_ids:
                yield chunk(event.text, None, event.token_ids)
        elif isinstance(event, Finished):
            yield chunk(None, event.output.finish_reason)
            if body.stream_options is not None and body.stream_options.include_usage:
                yield {"id": rid, "object": kind, "created": created, "model": model,
                       "choices": [], "usage": _usage(prompt_len, event.output)}
        else:
            yield _error_chunk(event)

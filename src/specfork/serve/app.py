"""The OpenAI-compatible HTTP API over one shared :class:`EngineLoop`.

Routes: GET /v1/models (and /v1/models/{id}), POST /v1/completions, POST /v1/chat/completions
(streaming with SSE and ``data: [DONE]``, or not), POST /tokenize and /detokenize (vLLM's), GET
/health, GET /metrics (Prometheus text). With an API key, every /v1 route and the tokenizer routes
want ``Authorization: Bearer <key>``.

The event loop only moves bytes: bodies are read with a size limit, and parsing, validation,
templating and tokenizing run on worker threads (``preprocess``), as does formatting a large
response.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import aclosing, asynccontextmanager
from dataclasses import dataclass

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from specfork.outputs import RequestOutput
from specfork.serve.engine_loop import (
    Admitted,
    EngineLoop,
    EngineStopped,
    Event,
    Failed,
    Finished,
    Piece,
    QueueFull,
    RequestGroup,
)
from specfork.serve.metrics import ServerMetrics
from specfork.serve.preprocess import Job, detokenize, prepare_chat, prepare_completion, tokenize
from specfork.serve.protocol import ApiError, GenerationRequest
from specfork.serve.responses import ChunkMaker, TokenNames, response_body, shown

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5
RETRY_AFTER_S = "1"
CLIENT_CLOSED = 499  # nginx's status for a client that closed the connection before the reply


@dataclass(frozen=True, slots=True)
class AppOptions:
    served_model_name: str
    max_request_bytes: int
    api_key: str | None = None


class AsciiJSONResponse(JSONResponse):
    """JSON with every non-ASCII character escaped: any Python string encodes, even one holding
    a lone surrogate a client sent."""

    def render(self, content: object) -> bytes:
        return json.dumps(content, ensure_ascii=True, separators=(",", ":")).encode("ascii")


def error_response(error: ApiError) -> JSONResponse:
    headers = dict(error.headers or {})
    if error.status == 413:
        headers["Connection"] = "close"  # the rest of the body is never read
    return AsciiJSONResponse(error.body(), status_code=error.status, headers=headers or None)


def build_app(loop: EngineLoop, metrics: ServerMetrics, options: AppOptions) -> FastAPI:
    """``loop`` must be started; the app shuts it down when the server stops."""
    engine = loop.llm.engine
    names = TokenNames(engine.tokenizer)
    served = options.served_model_name
    created = int(time.time())

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        yield
        # uvicorn has stopped taking requests and waited for open ones (see server.py: the loop
        # cut what still ran at the end of the grace period); now the engine and drafter stop.
        await asyncio.to_thread(loop.shutdown)

    app = FastAPI(title="specfork", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, error: ApiError) -> JSONResponse:
        if error.status != CLIENT_CLOSED:  # a client that went away is counted as a disconnect, not an error
            metrics.request_failed(error.status)
        return error_response(error)

    @app.exception_handler(HTTPException)
    async def _routing_error(request: Request, error: HTTPException) -> JSONResponse:
        # An unknown route (404) or method (405): the OpenAI error body, so clients show the message.
        reason = {404: "no such route", 405: "method not allowed on this route"}.get(error.status_code, error.detail)
        metrics.request_failed(error.status_code)
        return error_response(ApiError(error.status_code, f"{reason}: {request.method} {request.url.path}",
                                       headers=dict(error.headers) if error.headers else None))

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, error: Exception) -> JSONResponse:
        logger.error("unexpected error", exc_info=error)
        metrics.request_failed(500)
        # The details stay in the log: a reply never shows internal exception text.
        return error_response(ApiError(500, "internal server error", kind="server_error"))

    async def authorize(request: Request) -> None:
        if options.api_key is None:
            return
        given = request.headers.get("authorization", "")
        scheme, _, key = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(key.strip().encode(), options.api_key.encode()):
            raise ApiError(401, "missing or incorrect API key (send Authorization: Bearer <key>)",
                           code="invalid_api_key")

    @app.get("/health")
    async def health() -> JSONResponse:
        state, why = loop.state
        body = {"status": state} if why is None else {"status": state, "reason": why}
        return AsciiJSONResponse(body, status_code=503 if state in ("stopping", "failed") else 200)

    @app.get("/metrics")
    async def prometheus() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(loop.snapshot, loop.num_active, loop.state[0]),
                                 media_type="text/plain; version=0.0.4")

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(authorize)])

    card = {"id": served, "object": "model", "created": created, "owned_by": "specfork",
            "max_model_len": engine.max_model_len, "vocab_size": engine.loaded.arch.vocab_size}

    @v1.get("/models")
    async def models() -> JSONResponse:
        return JSONResponse({"object": "list", "data": [card]})

    @v1.get("/models/{model:path}")
    async def model(model: str) -> JSONResponse:
        if model != served:
            raise ApiError(404, f"the model '{model}' does not exist; this server serves '{served}'",
                           param="model", code="model_not_found")
        return JSONResponse(card)

    async def generate(request: Request, prepare, prefix: str) -> Response | dict:
        raw = await read_body(request, options.max_request_bytes, metrics)
        job: Job = await asyncio.to_thread(prepare, raw, engine, served)
        group = await admit(loop, job)
        rid, now = f"{prefix}-{uuid.uuid4().hex}", int(time.time())
        if job.body.stream:
            chunks = ChunkMaker(job, rid, now, served, names)
            return sse(stream(loop, group, job, chunks, metrics))
        outputs = await wait_all(loop, group, request, metrics)
        return AsciiJSONResponse(await asyncio.to_thread(response_body, job, rid, now, served, outputs, names))

    @v1.post("/completions")
    async def completions(request: Request):
        return await generate(request, prepare_completion, "cmpl")

    @v1.post("/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, prepare_chat, "chatcmpl")

    app.include_router(v1)

    # vLLM's tokenizer routes (outside /v1, as there; the API key applies)
    @app.post("/tokenize", dependencies=[Depends(authorize)])
    async def tokenize_route(request: Request) -> JSONResponse:
        raw = await read_body(request, options.max_request_bytes, metrics)
        return AsciiJSONResponse(await asyncio.to_thread(tokenize, raw, engine, served))

    @app.post("/detokenize", dependencies=[Depends(authorize)])
    async def detokenize_route(request: Request) -> JSONResponse:
        raw = await read_body(request, options.max_request_bytes, metrics)
        return AsciiJSONResponse(await asyncio.to_thread(detokenize, raw, engine, served))

    return app


# ---- request handling -----------------------------------------------------------------------------


async def read_body(request: Request, limit: int, metrics: ServerMetrics) -> bytes:
    """The body, refused with 413 as soon as it is known to exceed ``limit`` bytes: from its
    Content-Length before reading anything, else while it streams in."""
    declared = request.headers.get("content-length")
    too_large = ApiError(413, f"the request body exceeds this server's limit of {limit} bytes (--max-request-bytes)",
                         code="request_too_large")
    if declared is not None:
        try:
            if int(declared) > limit:
                raise too_large
        except ValueError:
            raise ApiError(400, "Content-Length is not a number") from None
    parts, size = [], 0
    try:
        async for part in request.stream():
            size += len(part)
            if size > limit:
                raise too_large
            parts.append(part)
    except ClientDisconnect:  # the client went away before sending its whole body
        metrics.client_disconnected()
        raise ApiError(CLIENT_CLOSED, "the client disconnected before sending the whole request body") from None
    return b"".join(parts)


async def admit(loop: EngineLoop, job: Job) -> RequestGroup:
    """Submit the request and wait until the engine took every choice, so that a request it
    refuses gets its 400 before any stream starts."""
    try:
        group = loop.submit([job.prompts[job.prompt_of(i)] for i in range(len(job.params))], job.params)
    except QueueFull as e:
        if len(job.params) > loop.max_active:
            many = f"n = {len(job.params)}" if len(job.prompts) == 1 else \
                f"{len(job.prompts)} prompts x n = {len(job.params)} choices"
            raise ApiError(400, f"{many} exceeds what this server can run at once ({loop.max_active})",
                           param="n") from None
        raise ApiError(503, str(e), kind="server_overloaded", code="queue_full",
                       headers={"Retry-After": RETRY_AFTER_S}) from None
    except EngineStopped as e:
        raise ApiError(503, str(e), kind="server_error", code="unavailable",
                       headers={"Retry-After": RETRY_AFTER_S}) from None
    admitted, early = 0, []
    try:
        while admitted < len(group.handles):
            index, event = await group.events.get()
            if isinstance(event, Admitted):
                admitted += 1
            elif isinstance(event, Failed):
                error = _api_error(event, job.body)
                if len(job.prompts) > 1:  # which prompt of the batch the engine refused
                    error.message = f"prompt.{job.prompt_of(index)}: {error.message}"
                raise error
            else:
                early.append((index, event))
    except BaseException:
        loop.abort(group)
        raise
    for item in early:  # (never expected: every Admitted is sent before any output)
        group.events.put_nowait(item)
    return group


def _api_error(event: Failed, body: GenerationRequest | None = None) -> ApiError:
    """The HTTP error of a failed request; ``body`` names the refused parameter as the request did."""
    if event.status == 400:
        return ApiError(400, event.message, param=body.field_of(event.param) if body else event.param)
    headers = {"Retry-After": RETRY_AFTER_S} if event.status == 503 else None
    return ApiError(event.status, event.message, kind="server_error", headers=headers)


async def wait_all(loop: EngineLoop, group: RequestGroup, request: Request,
                   metrics: ServerMetrics) -> list[RequestOutput]:
    """Every choice's finished output; cancels the request if the client disconnects first (asked
    every DISCONNECT_POLL_S, whether events arrive or not: a running request sends one a step)."""
    outputs: dict[int, RequestOutput] = {}
    clock = asyncio.get_running_loop().time
    next_check = clock() + DISCONNECT_POLL_S
    try:
        while len(outputs) < len(group.handles):
            try:
                index, event = await asyncio.wait_for(group.events.get(), max(0.0, next_check - clock()))
            except TimeoutError:
                event = None
            if clock() >= next_check:
                if await request.is_disconnected():
                    metrics.client_disconnected()
                    raise ApiError(CLIENT_CLOSED, "the client disconnected") from None
                next_check = clock() + DISCONNECT_POLL_S
            if event is None:
                continue
            if isinstance(event, Failed):
                raise _api_error(event)
            if isinstance(event, Finished):
                if event.output.finish_reason == "abort":
                    raise ApiError(503, "the server is shutting down; the request was cancelled before it "
                                   "finished", kind="server_error", code="shutting_down",
                                   headers={"Retry-After": RETRY_AFTER_S})
                outputs[index] = event.output
    finally:
        loop.abort(group)
    return [outputs[i] for i in range(len(group.handles))]


def sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    async def encode() -> AsyncIterator[str]:
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(encode(), media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


async def events(loop: EngineLoop, group: RequestGroup, metrics: ServerMetrics) -> AsyncIterator[tuple[int, Event]]:
    """The group's events until every choice ended (or one failed). If the consumer stops
    early (the client went away mid-stream) the request is cancelled and counted."""
    ended, complete = 0, False
    try:
        while ended < len(group.handles):
            index, event = await group.events.get()
            if isinstance(event, Failed):
                complete = True
                yield index, event
                return
            ended += isinstance(event, Finished)
            complete = ended == len(group.handles)
            yield index, event
    finally:
        if not complete:
            metrics.client_disconnected()
        loop.abort(group)


async def stream(loop: EngineLoop, group: RequestGroup, job: Job, chunks: ChunkMaker,
                 metrics: ServerMetrics) -> AsyncIterator[dict]:
    """The SSE payloads of one request: per choice an opening (chat), the echoed prompt
    (completions with echo), its pieces and a final chunk with its finish_reason ("abort" when
    the server cut it at shutdown); then the usage chunk if asked for (and with
    continuous_usage_stats, each chunk its choice's usage so far, as vLLM does)."""
    n = len(group.handles)
    options = job.body.stream_options
    continuous = options is not None and options.include_usage and options.continuous_usage_stats
    generated = [0] * n  # tokens of each choice so far

    def sent(chunk: dict, index: int) -> dict:
        return chunks.with_usage_so_far(chunk, index, generated[index]) if continuous else chunk

    for index in range(n):
        opening = chunks.opening(index)
        if opening is not None:
            yield sent(opening, index)
    echoed = [job.echo_texts is None] * n
    finished: dict[int, RequestOutput] = {}
    async with aclosing(events(loop, group, metrics)) as incoming:
        async for index, event in incoming:
            if isinstance(event, Failed):
                yield _api_error(event).body()
                return
            if not echoed[index] and isinstance(event, Piece | Finished):
                echoed[index] = True
                prompt = event.prompt_logprobs if isinstance(event, Piece) else event.output.prompt_logprobs
                yield sent(chunks.echo(index, prompt), index)
            if isinstance(event, Piece):
                if job.scores_only:
                    continue
                generated[index] += len(event.token_ids)
                if event.text or (event.token_ids and (job.body.return_token_ids or event.logprobs is not None)):
                    yield sent(chunks.piece(index, event.text, event.token_ids, event.logprobs), index)
            elif isinstance(event, Finished):
                finished[index] = shown(job, event.output)
                generated[index] = len(finished[index].token_ids)
                yield sent(chunks.choice(index, None, finish_reason=finished[index].finish_reason), index)
    if options is not None and options.include_usage and len(finished) == n:
        yield chunks.usage([finished[i] for i in range(n)])

"""`fly serve`: an OpenAI-compatible HTTP endpoint over one engine (FastAPI on uvicorn).

Requests enter the engine in arrival order, as many at once as it decodes together (``Admission``); each reply is generated in a worker thread
and streamed back as it is committed. A client that leaves mid-stream ends its generation at the next
committed piece. Errors are OpenAI-shaped JSON: 400 for a bad request (fly's own message), 401 without the
API key, 413 for a body over the limit, 429 / 503 with Retry-After when the queue is full or a request timed
out waiting.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException

from fly_integrations.messages import response_schema, tool_choice
from fly_integrations.params import FlyParams
from fly_integrations.prompting import check_messages
from fly_integrations.replies import ReplyRequest, stream_reply
from fly_integrations.server import protocol, schema
from fly_integrations.server.admission import Admission, QueueFull, QueueTimeout
from fly_integrations.server.metrics import CONTENT_TYPE, CountResponses, Metrics
from fly_integrations.streaming import aiter_in_thread
from fly_runtime.embeddings import DEFAULT_EMBEDDING, Embedder
from fly_runtime.errors import EngineBusyError, FlyError


@dataclasses.dataclass
class ServerSettings:
    api_key: str | None = None
    queue_depth: int = 16  # requests waiting for the engine before new ones are refused (429)
    request_timeout: float | None = None  # seconds a request may wait and run, unless it asks for less
    max_body_bytes: int = 4 * 1024 * 1024
    embedding_model: str | None = DEFAULT_EMBEDDING  # /v1/embeddings' model, loaded on its first request


class _ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers


@dataclasses.dataclass
class _State:
    """What the handlers share: the settings, the engine and the queue in front of it."""

    params: FlyParams
    settings: ServerSettings
    engine: Any
    admission: Admission
    bodies: schema.BodyCheck | None = None  # the document's request rules, checked on every request
    metrics: Metrics = dataclasses.field(default_factory=Metrics)
    embedder: Embedder | None = None

    @property
    def model_id(self) -> str:
        return self.params.target


router = APIRouter()


def create_app(params: FlyParams, settings: ServerSettings) -> FastAPI:
    """The app for one model pair (loaded here, before the first request)."""
    app = FastAPI(title="fly", version="1", description=_DESCRIPTION)
    engine = params.engine()
    embedder = Embedder(settings.embedding_model) if settings.embedding_model else None
    state = app.state.fly = _State(params, settings, engine, Admission(settings.queue_depth, engine.slots.count),
                                   embedder=embedder)
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    app.add_middleware(CountResponses, metrics=state.metrics, paths={route.path for route in router.routes})
    app.add_exception_handler(_ApiError, _api_error)
    app.add_exception_handler(RequestValidationError, _bad_body)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _internal)
    app.include_router(router)
    app.openapi = lambda: _openapi(app)
    app.state.fly.bodies = schema.BodyCheck(app.openapi())
    return app


def _openapi(app: FastAPI) -> dict[str, Any]:
    """FastAPI's document, less the 422 it adds to every route with a body: a malformed body is answered 400."""
    if app.openapi_schema is None:
        document = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
        for operation in (op for path in document["paths"].values() for op in path.values()):
            operation["responses"].pop("422", None)
        for name in ("HTTPValidationError", "ValidationError"):
            document.get("components", {}).get("schemas", {}).pop(name, None)
        state = app.state.fly
        schema.limit_max_tokens(document, min(state.params.context_window or state.engine.max_context,
                                              state.engine.max_context))
        app.openapi_schema = document
    return app.openapi_schema


_DESCRIPTION = ("An OpenAI-compatible endpoint over fly's engine. Requests take the OpenAI fields and fly's own "
                "settings (mode, k, window, ...) as extra fields; errors are OpenAI-shaped.")


# ------------------------------------------------------------------------------------------------ errors
async def _api_error(_: Request, exc: _ApiError) -> JSONResponse:
    return JSONResponse(protocol.error_body(str(exc), exc.kind), exc.status, headers=exc.headers)


async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
    message = f"invalid request: {first.get('msg', 'malformed body')}" + (f" at {where}" if where else "")
    if not where and "json" not in request.headers.get("content-type", ""):
        message = "the body must be a JSON object sent with 'Content-Type: application/json'"
    return JSONResponse(protocol.error_body(message, "invalid_request_error", param=where or None), 400)


async def _http_error(_: Request, exc: HTTPException) -> JSONResponse:
    # 405 carries its Allow header, as HTTP requires
    return JSONResponse(protocol.error_body(str(exc.detail), "invalid_request_error"), exc.status_code,
                        headers=getattr(exc, "headers", None))


async def _internal(_: Request, exc: Exception) -> JSONResponse:
    return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)


# ------------------------------------------------------------------------------------------------ helpers
def _state(request: Request) -> _State:
    return request.app.state.fly


def _authorize(request: Request) -> _State:
    state = _state(request)
    if state.settings.api_key is not None:
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {state.settings.api_key}".encode()):
            raise _ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            "authentication_error")
    return state


def _timeout(state: _State, asked: float | None) -> float | None:
    limits = [t for t in (asked, state.settings.request_timeout) if t is not None]
    return min(limits) if limits else None


async def _events(state: _State, opened: Any, timeout: float | None) -> AsyncIterator[Any]:
    """The items of a generation, once it is this request's turn on the engine."""
    start = time.perf_counter()
    admission = state.admission
    try:
        async with admission.turn(timeout):
            left = None if timeout is None else max(0.001, timeout - (time.perf_counter() - start))
            async for item in aiter_in_thread(lambda: opened(left)):
                if not isinstance(item, str):  # the generation's result: its figures join /metrics
                    state.metrics.generation(item)
                yield item
    except QueueFull as exc:
        raise _ApiError(429, f"the server is busy ({admission.waiting} requests waiting): retry later",
                        "rate_limit_error", {"Retry-After": str(exc.retry_after)}) from None
    except QueueTimeout as exc:
        raise _ApiError(503, "the request timed out waiting for the model: retry later or raise its timeout",
                        "server_error", {"Retry-After": str(exc.retry_after)}) from None
    except EngineBusyError as exc:
        raise _ApiError(503, str(exc), "server_error", {"Retry-After": "1"}) from None
    except FlyError as exc:
        raise _ApiError(400, str(exc), "invalid_request_error") from None


async def _started(items: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """``items`` with the first awaited now, so that a request that fails before any output gets its status."""
    try:
        first = await items.__anext__()
    except StopAsyncIteration:
        raise _ApiError(500, "the generation ended without output", "server_error") from None

    async def chained() -> AsyncIterator[Any]:
        yield first
        async for item in items:
            yield item

    return chained()


async def _last(items: AsyncIterator[Any]) -> Any:
    last = None
    async for last in items:
        pass
    return last


def _sse(chunks: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    async def events() -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield f"data: {json.dumps(chunk, ensure_ascii=False)}\n\n"
        except _ApiError as exc:  # after the first byte the status is sent: the error is the last event
            yield f"data: {json.dumps(protocol.error_body(str(exc), exc.kind))}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(events(), media_type="text/event-stream")


def _chat_messages(state: _State, body: protocol.ChatRequest, raw: Any) -> list[dict[str, Any]]:
    """The request's messages, checked: by fly's own rules first (their errors say the fix in fly's words), then
    the body as sent (``raw``, before pydantic's conversions) by the document's."""
    try:
        messages = protocol.chat_messages(body.messages)
        check_messages(messages)
    except (KeyError, TypeError, AttributeError):  # a shape fly's converter does not know: the document names it
        messages = None
    state.bodies.check("ChatRequest", raw)
    return messages if messages is not None else protocol.chat_messages(body.messages)


# ------------------------------------------------------------------------------------------------ routes
@router.get("/health", response_model=schema.Health)
async def health(request: Request) -> dict[str, Any]:
    state = _state(request)
    return {"status": "ok", "model": state.model_id, "waiting": state.admission.waiting}


@router.get("/v1/models", response_model=schema.ModelList, responses=schema.ERRORS)
async def models(request: Request) -> dict[str, Any]:
    state = _authorize(request)
    return {"object": "list", "data": [{"id": state.model_id, "object": "model", "created": 0, "owned_by": "fly"}]}


@router.get("/metrics", response_class=PlainTextResponse, responses={**schema.METRICS, **schema.ERRORS})
async def metrics(request: Request) -> PlainTextResponse:
    state = _authorize(request)
    admission = state.admission
    text = state.metrics.render(admission.waiting, admission.running, admission.turns)
    return PlainTextResponse(text, media_type=CONTENT_TYPE)


@router.post("/v1/embeddings", response_model=schema.EmbeddingList, responses=schema.ERRORS)
async def embeddings(body: protocol.EmbeddingRequest, request: Request) -> dict[str, Any]:
    state = _authorize(request)
    if state.embedder is None:
        raise _ApiError(400, "this server has no embedding model: start it with --embedding-model NAME",
                        "invalid_request_error")
    try:
        dimensions = await asyncio.to_thread(lambda: state.embedder.dimensions)  # loads the model once
        texts = protocol.embedding_texts(body, dimensions)
        vectors, tokens = await asyncio.to_thread(state.embedder.embed, texts)
    except FlyError as exc:
        raise _ApiError(400, str(exc), "invalid_request_error") from None
    state.metrics.embedding(len(texts), tokens)
    return protocol.embedding_list(state.embedder.name, vectors, tokens, body.encoding_format)


@router.post("/v1/chat/completions", response_model=schema.ChatCompletion,
             responses={**schema.STREAMED, **schema.ERRORS})
async def chat(body: protocol.ChatRequest, request: Request) -> Any:
    state = _authorize(request)
    try:
        overrides = protocol.overrides(body)  # fly's own rules first: their errors say the fix in fly's words
        messages = _chat_messages(state, body, await request.json())  # checked before the request queues
        reply_request = state.params.reply_request(
            messages, protocol.stops(body.stop), overrides,
            tools=body.tools, tool_choice=tool_choice(body.tool_choice),
            json_schema=response_schema(body.response_format))
    except FlyError as exc:
        raise _ApiError(400, str(exc), "invalid_request_error") from None
    items = await _started(_events(state, lambda left: stream_reply(_with_timeout(reply_request, left)),
                                   _timeout(state, body.timeout)))
    head = protocol.Head.new("chatcmpl", state.model_id, overrides.get("mode", state.params.mode))
    if body.stream:
        return _sse(protocol.chat_chunks(head, items))
    return protocol.chat_completion(head, await _last(items))


@router.post("/v1/completions", response_model=schema.Completion, responses={**schema.STREAMED, **schema.ERRORS})
async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
    state = _authorize(request)
    prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
    try:
        if len(prompts) != 1 or not prompts[0]:
            raise _ApiError(400, "prompt must be one non-empty string", "invalid_request_error")
        overrides = protocol.overrides(body)
        state.bodies.check("CompletionRequest", await request.json())
        config = state.params.generation_config(protocol.stops(body.stop) or state.params.stop, **overrides)
    except FlyError as exc:
        raise _ApiError(400, str(exc), "invalid_request_error") from None
    # the prompt is the caller's whole text, read as written: control tokens in it are meant
    ids = state.engine.tokenizer.encode(prompts[0], add_special_tokens=True)
    opened = lambda left: _completion_items(state.engine, ids, dataclasses.replace(  # noqa: E731
        config, timeout=left or config.timeout))
    items = await _started(_events(state, opened, _timeout(state, body.timeout)))
    head = protocol.Head.new("cmpl", state.model_id, overrides.get("mode", state.params.mode))
    if body.stream:
        return _sse(protocol.completion_chunks(head, items))
    return protocol.text_completion(head, await _last(items))


def _with_timeout(request: ReplyRequest, seconds: float | None) -> ReplyRequest:
    """``request`` with its generations limited to the time left after waiting in the queue."""
    if seconds is None:
        return request
    build = request.config
    return dataclasses.replace(request, config=lambda extra: dataclasses.replace(build(extra), timeout=seconds))


def _completion_items(engine, ids: list[int], config):
    """A raw completion's text pieces, then its GenerationResult."""
    with engine.stream(ids, config) as stream:
        yield from stream
    yield stream.result


class _BodyLimit:
    """Refuse a request body over ``limit`` bytes with 413, whether it says its length or streams it."""

    def __init__(self, app, limit: int) -> None:
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await _refuse_body(send, self.limit)
            return
        seen = 0

        async def counted():
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.limit:
                    raise _BodyTooLarge()
            return message

        try:
            await self.app(scope, counted, send)
        except _BodyTooLarge:
            await _refuse_body(send, self.limit)


class _BodyTooLarge(Exception):
    pass


async def _refuse_body(send, limit: int) -> None:
    body = json.dumps(protocol.error_body(f"request body over {limit:,} bytes", "invalid_request_error")).encode()
    await send({"type": "http.response.start", "status": 413,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
    await send({"type": "http.response.body", "body": body})

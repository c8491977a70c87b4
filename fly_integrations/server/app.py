"""`fly serve`: an OpenAI-compatible HTTP endpoint over one engine (FastAPI on uvicorn).

Requests take turns on the engine in arrival order (``Admission``); each reply is generated in a worker thread
and streamed back as it is committed. A client that leaves mid-stream ends its generation at the next
committed piece. Errors are OpenAI-shaped JSON: 400 for a bad request (fly's own message), 401 without the
API key, 413 for a body over the limit, 429 / 503 with Retry-After when the queue is full or a request timed
out waiting.
"""

from __future__ import annotations

import dataclasses
import hmac
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from starlette.exceptions import HTTPException

from fly_integrations.params import FlyParams
from fly_integrations.prompting import check_messages
from fly_integrations.replies import Reply, ReplyRequest, stream_reply
from fly_integrations.server import protocol
from fly_integrations.server.admission import Admission, QueueFull, QueueTimeout
from fly_integrations.streaming import aiter_in_thread
from fly_runtime.errors import EngineBusyError, FlyError


@dataclasses.dataclass
class ServerSettings:
    api_key: str | None = None
    queue_depth: int = 16  # requests waiting for the engine before new ones are refused (429)
    request_timeout: float | None = None  # seconds a request may wait and run, unless it asks for less
    max_body_bytes: int = 4 * 1024 * 1024


class _ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.kind, self.headers = status, kind, headers


def create_app(params: FlyParams, settings: ServerSettings) -> FastAPI:
    """The app for one model pair (loaded here, before the first request)."""
    engine = params.engine()
    admission = Admission(settings.queue_depth)
    app = FastAPI(title="fly", version="1")
    app.add_middleware(_BodyLimit, limit=settings.max_body_bytes)
    model_id = params.target

    @app.exception_handler(_ApiError)
    async def api_error(_: Request, exc: _ApiError) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(exc), exc.kind), exc.status, headers=exc.headers)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        message = f"invalid request: {first.get('msg', 'malformed body')}" + (f" at {where}" if where else "")
        return JSONResponse(protocol.error_body(message, "invalid_request_error", param=where or None), 400)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse(protocol.error_body(str(exc.detail), "invalid_request_error"), exc.status_code)

    @app.exception_handler(Exception)
    async def internal(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(protocol.error_body(f"internal error: {type(exc).__name__}: {exc}", "server_error"), 500)

    def authorize(request: Request) -> None:
        if settings.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
            raise _ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'",
                            "authentication_error")

    def timeout_of(asked: float | None) -> float | None:
        limits = [t for t in (asked, settings.request_timeout) if t is not None]
        if asked is not None and asked <= 0:
            raise _ApiError(400, f"timeout must be > 0 seconds, got {asked}", "invalid_request_error")
        return min(limits) if limits else None

    async def events(opened: Any, timeout: float | None) -> AsyncIterator[Any]:
        """The items of a generation, once it is this request's turn on the engine."""
        start = time.perf_counter()
        try:
            async with admission.turn(timeout):
                left = None if timeout is None else max(0.001, timeout - (time.perf_counter() - start))
                async for item in aiter_in_thread(lambda: opened(left)):
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

    async def first_and_rest(items: AsyncIterator[Any]) -> tuple[Any, AsyncIterator[Any]]:
        """Await the first item, so that a request that fails before any output gets its status code."""
        try:
            return await items.__anext__(), items
        except StopAsyncIteration:
            raise _ApiError(500, "the generation ended without output", "server_error") from None

    @app.get("/health")
    async def health() -> dict[str, Any]:
        return {"status": "ok", "model": model_id, "waiting": admission.waiting}

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        authorize(request)
        return {"object": "list", "data": [{"id": model_id, "object": "model", "created": 0, "owned_by": "fly"}]}

    @app.post("/v1/chat/completions")
    async def chat(body: protocol.ChatRequest, request: Request) -> Any:
        authorize(request)
        try:
            overrides = protocol.overrides(body)
            messages = protocol.chat_messages(body.messages)
            check_messages(messages)  # settings and messages are checked before the request queues
            reply_request = params.reply_request(
                messages, protocol.stops(body.stop), overrides,
                tools=body.tools, tool_choice=protocol.tool_choice(body.tool_choice),
                json_schema=protocol.json_schema(body.response_format))
        except FlyError as exc:
            raise _ApiError(400, str(exc), "invalid_request_error") from None
        mode = overrides.get("mode", params.mode)

        def opened(left: float | None):
            return stream_reply(_with_timeout(reply_request, left))

        first, rest = await first_and_rest(events(opened, timeout_of(body.timeout)))
        ident, created = protocol.completion_id("chatcmpl"), protocol.now()
        if not body.stream:
            items = [first] + [item async for item in rest]
            done = items[-1]
            assert isinstance(done, Reply)
            message: dict[str, Any] = {"role": "assistant", "content": done.content or None}
            if done.tool_calls:
                message["tool_calls"] = protocol.tool_calls(done)
            return {"id": ident, "object": "chat.completion", "created": created, "model": model_id,
                    "choices": [{"index": 0, "message": message, "finish_reason": protocol.finish_reason(done)}],
                    "usage": protocol.usage(done.result.stats), "fly": protocol.fly_stats(done.result, mode)}

        def chunk(delta: dict[str, Any], finish: str | None = None) -> str:
            return _sse({"id": ident, "object": "chat.completion.chunk", "created": created, "model": model_id,
                         "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})

        async def body_stream() -> AsyncIterator[str]:
            yield chunk({"role": "assistant", "content": ""})
            try:
                async for item in _chain(first, rest):
                    if isinstance(item, str):
                        yield chunk({"content": item})
                        continue
                    calls = [dict(call, index=i) for i, call in enumerate(protocol.tool_calls(item))]
                    yield chunk({"tool_calls": calls} if calls else {}, protocol.finish_reason(item))
                    yield _sse({"id": ident, "object": "chat.completion.chunk", "created": created,
                                "model": model_id, "choices": [], "usage": protocol.usage(item.result.stats),
                                "fly": protocol.fly_stats(item.result, mode)})
            except _ApiError as exc:  # after the first byte the status is sent: the error is the last event
                yield _sse(protocol.error_body(str(exc), exc.kind))
            yield "data: [DONE]\n\n"

        return StreamingResponse(body_stream(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(body: protocol.CompletionRequest, request: Request) -> Any:
        authorize(request)
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        try:
            if len(prompts) != 1 or not prompts[0]:
                raise _ApiError(400, "prompt must be one non-empty string", "invalid_request_error")
            overrides = protocol.overrides(body)
            config = params.generation_config(protocol.stops(body.stop) or params.stop, **overrides)
        except FlyError as exc:
            raise _ApiError(400, str(exc), "invalid_request_error") from None
        # the prompt is the caller's whole text, read as written: control tokens in it are meant
        ids = engine.tokenizer.encode(prompts[0], add_special_tokens=True)
        mode = overrides.get("mode", params.mode)

        def opened(left: float | None):
            return _completion_items(engine, ids, dataclasses.replace(config, timeout=left or config.timeout))

        first, rest = await first_and_rest(events(opened, timeout_of(body.timeout)))
        ident, created = protocol.completion_id("cmpl"), protocol.now()
        if not body.stream:
            items = [first] + [item async for item in rest]
            result = items[-1]
            return {"id": ident, "object": "text_completion", "created": created, "model": model_id,
                    "choices": [{"index": 0, "text": result.text, "logprobs": None,
                                 "finish_reason": "length" if result.finish_reason != "stop" else "stop"}],
                    "usage": protocol.usage(result.stats), "fly": protocol.fly_stats(result, mode)}

        async def body_stream() -> AsyncIterator[str]:
            try:
                async for item in _chain(first, rest):
                    if isinstance(item, str):
                        piece = {"index": 0, "text": item, "logprobs": None, "finish_reason": None}
                        yield _sse({"id": ident, "object": "text_completion", "created": created,
                                    "model": model_id, "choices": [piece]})
                        continue
                    last = {"index": 0, "text": "", "logprobs": None,
                            "finish_reason": "length" if item.finish_reason != "stop" else "stop"}
                    yield _sse({"id": ident, "object": "text_completion", "created": created, "model": model_id,
                                "choices": [last], "usage": protocol.usage(item.stats),
                                "fly": protocol.fly_stats(item, mode)})
            except _ApiError as exc:
                yield _sse(protocol.error_body(str(exc), exc.kind))
            yield "data: [DONE]\n\n"

        return StreamingResponse(body_stream(), media_type="text/event-stream")

    return app


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


async def _chain(first: Any, rest: AsyncIterator[Any]) -> AsyncIterator[Any]:
    yield first
    async for item in rest:
        yield item


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


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

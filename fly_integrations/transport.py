"""Where an adapter's replies come from, chosen once when the adapter is built: the engine in this process
(``Local``) or a server speaking OpenAI's chat API (``Remote``: `fly serve`, or vLLM with FLy) through the
``openai`` client's public API. Both yield the same items for one call: text deltas (``Reasoning`` deltas
for a thinking model's reasoning), then one ``Reply`` with the tool calls and the usage, so the adapters
have one path from a call to their chunks and messages."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

from fly_integrations.messages import openai_tool_choice
from fly_integrations.params import OPENAI_FIELDS, OVERRIDABLE
from fly_integrations.reasoning import Reasoning
from fly_integrations.replies import Reply, stream_reply
from fly_integrations.streaming import aiter_in_thread
from fly_integrations.tool_calls import InvalidToolCall, ToolCall, arguments_of
from fly_runtime.engine import GenerationResult, GenerationStats


@dataclass
class Call:
    """One chat call: fly's chat dicts, the stops, per-call keywords, and what the framework bound."""

    messages: list[dict[str, Any]]
    stop: list[str] | None
    kwargs: dict[str, Any]
    model: str | None = None  # a per-call target (LangChain's model=)
    tools: list[dict[str, Any]] | None = None  # OpenAI tool dicts
    tool_choice: Any = None  # fly's spelling: auto, none, any, a tool's name
    json_schema: dict[str, Any] | None = None  # the reply's schema ({}: any JSON object)


class Local:
    """The engine in this process. ``params`` (the adapter: its settings) is given with each call, so a copy of
    an adapter with other settings is served by its own."""

    remote = False

    def stream(self, params, call: Call) -> Iterator[str | Reply]:
        return stream_reply(self._request(params, call))

    def astream(self, params, call: Call) -> AsyncIterator[str | Reply]:
        request = self._request(params, call)  # checked here, before a worker thread starts
        return aiter_in_thread(lambda: stream_reply(request))

    @staticmethod
    def _request(params, call: Call):
        return params.reply_request(call.messages, call.stop, call.kwargs, model=call.model, tools=call.tools,
                                    tool_choice=call.tool_choice, json_schema=call.json_schema)


class Remote:
    """A server at ``base_url`` speaking OpenAI's chat API, streamed with usage; fly's own settings ride as extra
    body fields. Async calls get a client of the running event loop's own (an HTTP client bound to a loop that has
    closed fails)."""

    remote = True

    def __init__(self, base_url: str, api_key: str | None, max_retries: int = 0, timeout: float | None = None) -> None:
        self._options = {"base_url": base_url, "api_key": api_key or "none", "max_retries": max_retries,
                         "timeout": timeout}
        self._client = None
        self._async_client: tuple[Any, Any] | None = None

    def stream(self, params, call: Call) -> Iterator[str | Reply]:
        body = self._body(params, call)
        if self._client is None:
            from openai import OpenAI

            self._client = OpenAI(**self._options)
        reader = _StreamReader(body["model"])
        with self._client.chat.completions.create(**body) as chunks:
            for chunk in chunks:
                yield from reader.read(chunk)
        yield reader.reply()

    async def astream(self, params, call: Call) -> AsyncIterator[str | Reply]:
        body = self._body(params, call)
        loop = asyncio.get_running_loop()
        if self._async_client is None or self._async_client[0] is not loop:
            from openai import AsyncOpenAI

            self._async_client = (loop, AsyncOpenAI(**self._options))
        reader = _StreamReader(body["model"])
        async with await self._async_client[1].chat.completions.create(**body) as chunks:
            async for chunk in chunks:
                for item in reader.read(chunk):
                    yield item
        yield reader.reply()

    @staticmethod
    def _body(params, call: Call) -> dict[str, Any]:
        """The request: OpenAI's fields at the top, fly's settings as extra body fields; a bad setting raises
        fly's error here, before anything is sent."""
        stops, overrides, schema = params.call_settings(call.stop, call.kwargs, call.json_schema)
        settings = {name: overrides.get(name, getattr(params, name)) for name in OVERRIDABLE}
        body: dict[str, Any] = {
            "model": call.model or params.target, "messages": [_openai_message(m) for m in call.messages],
            "stream": True, "stream_options": {"include_usage": True},
            **{name: settings[name] for name in OPENAI_FIELDS if settings[name] is not None},
            "extra_body": {name: value for name, value in settings.items() if name not in OPENAI_FIELDS},
        }
        if stops:
            body["stop"] = stops
        if call.tools:
            body["tools"] = call.tools
            if call.tool_choice is not None:
                body["tool_choice"] = openai_tool_choice(call.tool_choice)
        if schema is not None:
            body["response_format"] = ({"type": "json_schema", "json_schema": {"name": "reply", "schema": schema}}
                                       if schema else {"type": "json_object"})
        return body


def _openai_message(message: dict[str, Any]) -> dict[str, Any]:
    """A fly chat dict as an OpenAI message: a call's arguments as JSON text."""
    out = dict(message)
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"id": c["id"], "type": "function", "function": {
                "name": c["function"]["name"],
                "arguments": a if isinstance(a := c["function"]["arguments"], str) else json.dumps(a)}}
            for c in message["tool_calls"]]
    return out


class _StreamReader:
    """OpenAI chat chunks as fly's items: text and reasoning deltas as they come, the calls' pieces gathered, and
    at the end a Reply whose stats are the server's usage and (from `fly serve`) fly's own figures."""

    def __init__(self, model: str) -> None:
        self.model = model
        self.content = self.reasoning = ""
        self.calls: dict[int, dict[str, str]] = {}
        self.finish = "stop"
        self.usage: Any = None
        self.fly: dict[str, Any] = {}

    def read(self, chunk) -> Iterator[str]:
        if chunk.usage is not None:
            self.usage = chunk.usage
            self.fly = (chunk.model_extra or {}).get("fly") or {}
        for choice in chunk.choices:
            delta = choice.delta
            if thought := (delta.model_extra or {}).get("reasoning_content"):
                self.reasoning += thought
                yield Reasoning(thought)
            if delta.content:
                self.content += delta.content
                yield delta.content
            for piece in delta.tool_calls or ():
                call = self.calls.setdefault(piece.index, {"id": "", "name": "", "arguments": ""})
                call["id"] = piece.id or call["id"]
                if piece.function is not None:
                    call["name"] += piece.function.name or ""
                    call["arguments"] += piece.function.arguments or ""
            if choice.finish_reason:
                self.finish = "length" if choice.finish_reason == "length" else "stop"

    def reply(self) -> Reply:
        calls, invalid = [], []
        for call in (self.calls[i] for i in sorted(self.calls)):
            arguments = arguments_of(call["arguments"])
            if isinstance(arguments, dict):
                calls.append(ToolCall(call["name"], arguments, **({"id": call["id"]} if call["id"] else {})))
            else:
                invalid.append(InvalidToolCall(call["arguments"], arguments, call["name"] or None))
        result = GenerationResult(self.content, [], self.finish, self._stats(), self.fly.get("draft_model"),
                                  self.fly.get("target_form"))
        return Reply(self.content, calls, result, invalid, self.reasoning)

    def _stats(self) -> GenerationStats:
        usage, fly = self.usage, self.fly
        if usage is None:
            return GenerationStats()
        details = getattr(usage, "prompt_tokens_details", None)
        new = usage.completion_tokens
        tau, speed = fly.get("mean_accepted") or 0.0, fly.get("tokens_per_second") or 0.0
        return GenerationStats(prompt_tokens=usage.prompt_tokens, new_tokens=new,
                               cached_tokens=(getattr(details, "cached_tokens", None) or 0),
                               target_forwards=round(new / tau) if tau else 0,
                               fly_forgiven=fly.get("fly_forgiven") or 0, seconds=new / speed if speed else 0.0)


def transport(base_url: str | None, api_key: str | None = None, max_retries: int = 0,
              timeout: float | None = None) -> Local | Remote:
    """The adapter's transport: a server where ``base_url`` is given, else this process's engine."""
    return Remote(base_url, api_key, max_retries, timeout) if base_url else Local()

"""The OpenAI request and response shapes `fly serve` speaks, and their translation to fly's own."""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from fly_integrations.params import OVERRIDABLE
from fly_integrations.replies import Reply
from fly_runtime.errors import InvalidPromptError


class ChatRequest(BaseModel):
    # fly's own settings ride as extra fields (mode, k, window, ...), as vLLM takes its extra sampling parameters
    model_config = ConfigDict(extra="allow")

    messages: list[dict[str, Any]]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    n: int = 1
    timeout: float | None = None  # fly: seconds this request may wait and run


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    prompt: str | list[str]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: int | None = 16
    temperature: float | None = None
    top_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    timeout: float | None = None


def overrides(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The request's settings for fly: the OpenAI sampling fields and fly's extra fields (unknown extras are
    an error naming the known ones, not silently dropped)."""
    extra = dict(request.model_extra or {})
    unknown = sorted(set(extra) - set(OVERRIDABLE) - _IGNORED)
    if unknown:
        raise InvalidPromptError(f"unknown request field(s) {unknown}: fly takes the OpenAI fields and its own "
                                 f"settings {sorted(set(OVERRIDABLE) - {'max_tokens'})}")
    if request.n != 1:
        raise InvalidPromptError(f"n must be 1 (fly generates one choice per request), got {request.n}")
    values = {k: v for k, v in extra.items() if k in OVERRIDABLE}
    budget = getattr(request, "max_completion_tokens", None) or request.max_tokens
    for name, value in (("max_tokens", budget), ("temperature", request.temperature), ("top_p", request.top_p),
                        ("seed", request.seed)):
        if value is not None:
            values[name] = value
    return values


# OpenAI fields fly accepts and has no use for
_IGNORED = {"user", "logit_bias", "frequency_penalty", "presence_penalty", "parallel_tool_calls", "store",
            "metadata", "service_tier", "logprobs", "top_logprobs"}


def stops(stop: str | list[str] | None) -> list[str] | None:
    return [stop] if isinstance(stop, str) else stop


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as fly's chat dicts: text parts joined, call arguments parsed from JSON strings."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPromptError(f"message {i} must be an object with a role and content")
        converted = {k: v for k, v in message.items() if k in ("role", "content", "tool_call_id", "name")}
        converted["content"] = _text(message.get("content"), i)
        if message.get("role") == "developer":
            converted["role"] = "system"
        if message.get("tool_calls"):
            converted["tool_calls"] = [
                {"type": "function", "id": call.get("id"),
                 "function": {"name": call["function"]["name"], "arguments": _arguments(call["function"], i)}}
                for call in message["tool_calls"]]
        out.append(converted)
    return out


def _text(content: Any, index: int) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = []
        for part in content:
            if not (isinstance(part, dict) and part.get("type") == "text"):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise InvalidPromptError(f"message {index} has a {kind!r} content part; this model reads text only")
            parts.append(part.get("text", ""))
        return "".join(parts)
    raise InvalidPromptError(f"message {index} content must be a string or a list of text parts")


def _arguments(function: dict[str, Any], index: int) -> dict[str, Any]:
    arguments = function.get("arguments") or "{}"
    if isinstance(arguments, dict):
        return arguments
    try:
        return json.loads(arguments)
    except json.JSONDecodeError:
        raise InvalidPromptError(f"message {index}: the arguments of tool call {function.get('name')!r} are not "
                                 "a JSON object") from None


def tool_choice(choice: str | dict[str, Any] | None) -> str | None:
    """OpenAI's tool_choice as fly's: 'required' -> 'any', a named function -> its name."""
    if isinstance(choice, dict):
        return (choice.get("function") or {}).get("name")
    return "any" if choice == "required" else choice


def openai_tool_choice(choice: Any) -> Any:
    """fly's tool_choice as OpenAI's: 'any' -> 'required', a tool's name -> that function."""
    if choice == "any":
        return "required"
    if isinstance(choice, str) and choice not in ("auto", "none", "required"):
        return {"type": "function", "function": {"name": choice}}
    return choice


def json_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    if not response_format or response_format.get("type") == "text":
        return None
    if response_format.get("type") == "json_object":
        return {}
    if response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema") or {}
        return spec.get("schema", {})
    raise InvalidPromptError(f"response_format type must be text, json_object or json_schema, got "
                             f"{response_format.get('type')!r}")


def usage(stats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def fly_stats(result, mode: str) -> dict[str, Any]:
    """fly's own figures, in an extra field beside OpenAI's usage."""
    s = result.stats
    return {"mode": mode, "mean_accepted": s.mean_accepted, "fly_forgiven": s.fly_forgiven,
            "cached_tokens": s.cached_tokens, "tokens_per_second": s.tokens_per_second, "draft_model": result.draft_model}


def finish_reason(reply: Reply) -> str:
    if reply.tool_calls:
        return "tool_calls"
    return {"stop": "stop", "length": "length", "timeout": "length"}.get(reply.result.finish_reason, "stop")


def tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in reply.tool_calls]


def completion_id(kind: Literal["chatcmpl", "cmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


"""The OpenAI request and response shapes `fly serve` speaks, and their translation to fly's own."""

from __future__ import annotations

import base64
import json
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema

from fly_integrations.messages import chat_message, usage
from fly_integrations.params import OVERRIDABLE
from fly_integrations.reasoning import Reasoning
from fly_integrations.replies import Reply
from fly_integrations.server import schema
from fly_runtime.errors import InvalidPromptError


MAX_EMBEDDING_INPUTS = 2048  # OpenAI's limit on texts a request


class ChatRequest(BaseModel):
    # fly's own settings ride as extra fields (mode, k, window, ...), as vLLM takes its extra sampling parameters;
    # they are checked by fly (its messages), and the document lists them (schema.request_schema)
    model_config = ConfigDict(extra="allow", json_schema_extra=schema.request_schema)

    messages: Annotated[list[dict[str, Any]], WithJsonSchema(schema.MESSAGES)]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = None
    max_completion_tokens: Annotated[int | None, Field(ge=1)] = None
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    seed: Annotated[int | None, Field(ge=0, le=2**53 - 1)] = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(schema.STOP)] = None
    tools: Annotated[list[dict[str, Any]] | None, WithJsonSchema(schema.TOOLS)] = None
    tool_choice: Annotated[str | dict[str, Any] | None, WithJsonSchema(schema.TOOL_CHOICE)] = None
    response_format: Annotated[dict[str, Any] | None, WithJsonSchema(schema.RESPONSE_FORMAT)] = None
    n: Annotated[int, Field(ge=1, le=1)] = 1  # fly generates one choice per request
    timeout: Annotated[float | None, Field(gt=0)] = None  # fly: seconds this request may wait and run


class CompletionRequest(BaseModel):
    model_config = ConfigDict(extra="allow", json_schema_extra=schema.request_schema)

    prompt: Annotated[str | list[str], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1}, {"type": "array", "minItems": 1, "maxItems": 1,
                                             "items": {"type": "string", "minLength": 1}}]})]
    model: str | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    max_tokens: Annotated[int | None, Field(ge=1)] = 16
    temperature: Annotated[float | None, Field(ge=0, le=2)] = None
    top_p: Annotated[float | None, Field(gt=0, le=1)] = None
    seed: Annotated[int | None, Field(ge=0, le=2**53 - 1)] = None
    stop: Annotated[str | list[str] | None, WithJsonSchema(schema.STOP)] = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    timeout: Annotated[float | None, Field(gt=0)] = None


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")  # an unknown field is refused by name

    # texts (the document's only form); OpenAI also takes token ids, which name another model's tokenizer:
    # they are read here only to be refused with the fix
    input: Annotated[str | list[str] | list[int] | list[list[int]], WithJsonSchema({"anyOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "minItems": 1, "maxItems": MAX_EMBEDDING_INPUTS,
         "items": {"type": "string", "minLength": 1}}]})]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int | None, Field(ge=1, description="the model's own (384 for all-MiniLM-L6-v2): "
                                                               "vectors are not shortened")] = None
    user: str | None = None


def embedding_texts(request: EmbeddingRequest, dimensions: int) -> list[str]:
    """The request's texts, checked: strings only, none empty, at most MAX_EMBEDDING_INPUTS, and ``dimensions``
    (if sent) the model's own (its vectors are not shortened)."""
    texts = [request.input] if isinstance(request.input, str) else request.input
    if not texts or not all(isinstance(t, str) for t in texts):
        raise InvalidPromptError("input must be a string or a list of strings: token ids name another model's "
                                 "tokenizer (LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False))")
    if len(texts) > MAX_EMBEDDING_INPUTS:
        raise InvalidPromptError(f"input holds {len(texts)} texts: send at most {MAX_EMBEDDING_INPUTS} a request")
    if empty := [i for i, t in enumerate(texts) if not t]:
        raise InvalidPromptError(f"input {empty[0]} is an empty string: leave it out")
    if request.dimensions is not None and request.dimensions != dimensions:
        raise InvalidPromptError(f"dimensions {request.dimensions}: this embedding model writes {dimensions}; "
                                 "leave dimensions out")
    return texts


def embedding_list(model: str, vectors, tokens: int, encoding: str | None) -> dict[str, Any]:
    """OpenAI's embeddings response; base64 is the little-endian float32 bytes the openai client decodes."""
    def encoded(row) -> Any:
        return base64.b64encode(row.astype("<f4").tobytes()).decode() if encoding == "base64" else row.tolist()

    return {"object": "list", "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
            "data": [{"object": "embedding", "index": i, "embedding": encoded(row)} for i, row in enumerate(vectors)]}


def overrides(request: ChatRequest | CompletionRequest) -> dict[str, Any]:
    """The request's settings for fly: the OpenAI sampling fields and fly's extra fields (unknown extras are
    an error naming the known ones, not silently dropped)."""
    extra = {schema.ALIASES.get(k, k): v for k, v in (request.model_extra or {}).items()}
    unknown = sorted(set(extra) - set(OVERRIDABLE) - set(schema.IGNORED) - set(schema.UNSUPPORTED))
    if extra.get("logprobs") or extra.get("top_logprobs"):
        raise InvalidPromptError("logprobs / top_logprobs are not returned by fly: leave them out (or false / 0)")
    if unknown:
        raise InvalidPromptError(f"unknown request field(s) {unknown}: fly takes the OpenAI fields and its own "
                                 f"settings {sorted(set(OVERRIDABLE) - {'max_tokens'})}")
    values = {k: schema.as_json_type(k, v) for k, v in extra.items() if k in OVERRIDABLE}
    aliased = values.pop("max_tokens", None)  # n_predict / num_predict, where max_tokens is not set
    explicit = request.max_tokens if "max_tokens" in request.model_fields_set else None
    budget = getattr(request, "max_completion_tokens", None) or explicit or aliased or request.max_tokens
    for name, value in (("max_tokens", budget), ("temperature", request.temperature), ("top_p", request.top_p),
                        ("seed", request.seed)):
        if value is not None:
            values[name] = value
    return values


def stops(stop: str | list[str] | None) -> list[str] | None:
    return [stop] if isinstance(stop, str) else stop


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """OpenAI chat messages as fly's chat dicts (fly_integrations.messages): text parts joined."""
    out = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise InvalidPromptError(f"message {i} must be an object with a role and content")
        calls = None
        if message.get("role") == "assistant":  # only the assistant calls tools
            calls = [{"id": call.get("id"), "name": call["function"]["name"],
                      "arguments": call["function"].get("arguments")} for call in message.get("tool_calls") or ()]
        out.append(chat_message(message.get("role"), _text(message.get("content"), i), tool_calls=calls,
                                tool_call_id=message.get("tool_call_id"), name=message.get("name")))
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


def fly_stats(result, mode: str) -> dict[str, Any]:
    """fly's own figures, in an extra field beside OpenAI's usage."""
    s = result.stats
    return {"mode": mode, "mean_accepted": s.mean_accepted, "fly_forgiven": s.fly_forgiven,
            "cached_tokens": s.cached_tokens, "tokens_per_second": s.tokens_per_second, "draft_model": result.draft_model,
            "target_form": result.form}


def finish_reason(result, calls: bool = False) -> str:
    """OpenAI's finish reason for a GenerationResult: a timeout, like the budget, cut the reply short."""
    if calls:
        return "tool_calls"
    return "stop" if result.finish_reason == "stop" else "length"


def tool_calls(reply: Reply) -> list[dict[str, Any]]:
    return [{"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
            for c in reply.tool_calls]


@dataclass(frozen=True)
class Head:
    """What every object of one response carries."""

    object: str  # chat.completion, chat.completion.chunk or text_completion
    model: str
    mode: str
    id: str = ""
    created: int = 0

    @classmethod
    def new(cls, kind: Literal["chatcmpl", "cmpl"], model: str, mode: str) -> "Head":
        obj = "chat.completion" if kind == "chatcmpl" else "text_completion"
        return cls(obj, model, mode, completion_id(kind), now())

    def body(self, choices: list[dict[str, Any]], obj: str | None = None, **more: Any) -> dict[str, Any]:
        return {"id": self.id, "object": obj or self.object, "created": self.created, "model": self.model,
                "choices": choices, **more}

    def figures(self, result) -> dict[str, Any]:
        return {"usage": usage(result.stats), "fly": fly_stats(result, self.mode)}


def chat_completion(head: Head, reply: Reply) -> dict[str, Any]:
    message: dict[str, Any] = {"role": "assistant", "content": reply.content or None}
    if reply.reasoning:  # a thinking model's reasoning, under the name vLLM and DeepSeek's API give it
        message["reasoning_content"] = reply.reasoning
    if reply.tool_calls:
        message["tool_calls"] = tool_calls(reply)
    choice = {"index": 0, "message": message, "finish_reason": finish_reason(reply.result, bool(reply.tool_calls))}
    return head.body([choice], **head.figures(reply.result))


async def chat_chunks(head: Head, items: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """A streamed chat reply's chunks: the role, text deltas, the calls and finish reason, then usage."""
    chunk = "chat.completion.chunk"
    yield head.body([{"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}], chunk)
    async for item in items:
        if isinstance(item, str):
            delta = {"reasoning_content" if isinstance(item, Reasoning) else "content": str(item)}
            yield head.body([{"index": 0, "delta": delta, "finish_reason": None}], chunk)
            continue
        calls = [dict(call, index=i) for i, call in enumerate(tool_calls(item))]
        yield head.body([{"index": 0, "delta": {"tool_calls": calls} if calls else {},
                          "finish_reason": finish_reason(item.result, bool(calls))}], chunk)
        yield head.body([], chunk, **head.figures(item.result))


def text_completion(head: Head, result) -> dict[str, Any]:
    choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": finish_reason(result)}
    return head.body([choice], **head.figures(result))


async def completion_chunks(head: Head, items: AsyncIterator[Any]) -> AsyncIterator[dict[str, Any]]:
    """A streamed completion's chunks: text pieces, then the finish reason with usage."""
    async for item in items:
        if isinstance(item, str):
            yield head.body([{"index": 0, "text": item, "logprobs": None, "finish_reason": None}])
        else:
            yield head.body([{"index": 0, "text": "", "logprobs": None, "finish_reason": finish_reason(item)}],
                            **head.figures(item))


def completion_id(kind: Literal["chatcmpl", "cmpl"]) -> str:
    return f"{kind}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def error_body(message: str, kind: str, code: str | None = None, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


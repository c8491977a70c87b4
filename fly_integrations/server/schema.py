"""What `fly serve`'s OpenAPI document says: the shape of every response (errors included) and the rules a
request must follow, so that a client generated from the document, or a tool that checks a server against it
(schemathesis), finds the server doing what it says."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel

from fly_runtime.config import MODES
from fly_runtime.errors import InvalidPromptError


class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorBody(BaseModel):
    """OpenAI's error shape."""

    error: ErrorDetail


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int]


class FlyStats(BaseModel):
    """fly's own figures beside OpenAI's usage."""

    mode: str
    mean_accepted: float
    fly_forgiven: int
    cached_tokens: int
    tokens_per_second: float
    draft_model: str | None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object, as text


class ToolCall(BaseModel):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str | None
    reasoning_content: str | None = None  # a thinking model's reasoning, apart from its answer
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: Literal["stop", "length", "tool_calls"]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    fly: FlyStats


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: None
    finish_reason: Literal["stop", "length"]


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    fly: FlyStats


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok"]
    model: str
    waiting: int


class Embedding(BaseModel):
    object: Literal["embedding"]
    index: int
    embedding: list[float] | str  # a base64 string of little-endian float32 with encoding_format "base64"


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingList(BaseModel):
    object: Literal["list"]
    data: list[Embedding]
    model: str
    usage: EmbeddingUsage


METRICS = {200: {"content": {"text/plain": {"schema": {"type": "string"}}},
                 "description": "Prometheus' text format (version 0.0.4)"}}


_RETRY = {"Retry-After": {"description": "seconds to wait before retrying", "schema": {"type": "integer"}}}
ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": ErrorBody, "description": "a bad request: the message names the field and the fix"},
    401: {"model": ErrorBody, "description": "missing or wrong API key (servers started with --api-key)"},
    413: {"model": ErrorBody, "description": "the request body is over the server's limit (--max-body-mb)"},
    429: {"model": ErrorBody, "description": "the queue is full (--queue-depth): retry later", "headers": _RETRY},
    500: {"model": ErrorBody, "description": "a fault of the server's own"},
    503: {"model": ErrorBody, "description": "the request timed out waiting for the model", "headers": _RETRY},
}
# a streamed reply (stream: true) is a text/event-stream of JSON chunks, then "data: [DONE]"; before Open API
# 3.2 the schema of an event stream describes each event
_EVENT = {"type": "object", "required": ["data"], "properties": {
    "data": {"type": "string", "description": "a chunk (chat.completion.chunk or text_completion) as JSON, an "
                                              "error object as JSON, or [DONE]"},
    "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}
STREAMED = {200: {"content": {"text/event-stream": {"schema": _EVENT}},
                  "description": "the reply; with stream: true, server-sent events of chunks, then [DONE]"}}

# ------------------------------------------------------------------------------------------------ requests
_TEXT = {"type": "string", "pattern": r"\S"}  # holds something besides white space
_PART = {"type": "object", "required": ["type", "text"], "properties": {"type": {"const": "text"},
                                                                       "text": {"type": "string"}}}
_CONTENT = {"anyOf": [{"type": "string"}, {"type": "null"}, {"type": "array", "items": _PART}],
            "description": "text, or a list of text parts (this model reads text only)"}
_CALL = {"type": "object", "required": ["function"], "properties": {
    "id": {"type": ["string", "null"]}, "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string"},
        "arguments": {"type": ["string", "object"], "description": "a JSON object, as text (other text is kept as "
                                                                   "it is)"}}}}}
_MESSAGE = {"description": "one chat message", "oneOf": [
    {"type": "object", "required": ["role"], "properties": {
        "role": {"enum": ["system", "developer", "user"]}, "content": _CONTENT, "name": {"type": "string"}}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "assistant"}, "content": _CONTENT, "name": {"type": "string"},
        "tool_calls": {"type": ["array", "null"], "items": _CALL}}},
    {"type": "object", "required": ["role"], "properties": {
        "role": {"const": "tool"}, "content": _CONTENT, "tool_call_id": {"type": "string"},
        "name": {"type": "string"}}},
]}
# the model must be given something to answer: one message with text, or with a tool call
_SAYS_SOMETHING = {"anyOf": [
    {"type": "object", "required": ["content"], "properties": {"content": {"anyOf": [
        _TEXT, {"type": "array", "contains": {"type": "object", "properties": {"text": _TEXT}, "required": ["text"]}}]}}},
    {"type": "object", "required": ["role", "tool_calls"], "properties": {
        "role": {"const": "assistant"}, "tool_calls": {"type": "array", "minItems": 1}}}]}
MESSAGES = {"type": "array", "minItems": 1, "items": _MESSAGE, "contains": _SAYS_SOMETHING}

_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": {"type": "string", "pattern": "^[a-zA-Z0-9_-]{1,64}$"}, "description": {"type": "string"},
        "parameters": {"type": "object", "description": "a JSON schema of type object"}}}}}
_NULL = {"type": "null"}  # every optional field may be sent as null, as OpenAI clients do
TOOLS = {"anyOf": [{"type": "array", "items": _TOOL}, _NULL]}
TOOL_CHOICE = {"anyOf": [
    _NULL, {"enum": ["auto", "none", "required"]},
    {"type": "object", "required": ["type", "function"], "description": "a bound tool, by name",
     "properties": {"type": {"const": "function"}, "function": {
         "type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}}}}]}
RESPONSE_FORMAT = {"anyOf": [
    _NULL, {"type": "object", "required": ["type"], "properties": {"type": {"enum": ["text", "json_object"]}}},
    {"type": "object", "required": ["type", "json_schema"], "properties": {
        "type": {"const": "json_schema"},
        "json_schema": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "schema": {"type": "object"}, "strict": {"type": ["boolean", "null"]}}}}}]}
STOP = {"anyOf": [{"type": "string", "minLength": 1}, {"type": "array", "maxItems": 16,
                                                        "items": {"type": "string", "minLength": 1}}, {"type": "null"}]}

# fly's own settings, taken as extra fields of a request (as vLLM takes its sampling extras)
FLY_SETTINGS: dict[str, dict[str, Any]] = {
    "mode": {"enum": list(MODES)},
    "k": {"type": ["integer", "null"], "minimum": 1, "maximum": 32,
          "description": "drafts per round; with mode fly it must exceed window"},
    "window": {"type": "integer", "minimum": 0, "maximum": 31, "description": "FLy's deferred window; below k"},
    "entropy_threshold": {"type": "number", "minimum": 0},
    "entropy_top_k": {"type": "integer", "minimum": 1},
    "min_prob_ratio": {"type": "number", "minimum": 0, "maximum": 1},
    "exact_numbers": {"type": "boolean"},
    "exact_code": {"type": "boolean"},
    "exact_opening": {"type": "integer", "minimum": 0},
    "ngram": {"type": "boolean"},
    "suffix_drafts": {"type": "boolean"},
    "adaptive": {"type": "boolean"},
    "top_k": {"type": "integer", "minimum": 0},
    "min_p": {"type": "number", "minimum": 0, "exclusiveMaximum": 1},
    "repetition_penalty": {"type": "number", "minimum": 0.01, "maximum": 100},
    "frequency_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "warn_prompt_tokens": {"type": "integer", "minimum": 0},
    "context_window": {"type": ["integer", "null"], "minimum": 2,
                       "description": "most tokens the request may hold, prompt and reply: prompt tokens + max_tokens "
                                      "must fit"},
}
# other servers' names for fly's settings (llama-server's and Ollama's), taken as those, under the same rule
ALIASES: dict[str, str] = {"repeat_penalty": "repetition_penalty", "n_predict": "max_tokens",
                           "num_predict": "max_tokens"}
_RULES = FLY_SETTINGS | {"max_tokens": {"type": "integer", "minimum": 1}}
# fields fly accepts and has no use for: OpenAI's, and llama-server's cache_prompt (fly always reuses a cached
# prefix)
IGNORED = ("user", "logit_bias", "parallel_tool_calls", "store", "metadata", "service_tier", "cache_prompt")
# OpenAI fields fly refuses where they ask for something it does not give
UNSUPPORTED = {"logprobs": {"enum": [False, None]}, "top_logprobs": {"enum": [0, None]}}


class BodyCheck:
    """Checks request bodies against the request schemas of the served document, so that the server takes exactly
    what its document says it takes (JSON's types: a boolean is no integer, though Python's bool is an int)."""

    def __init__(self, document: dict[str, Any]) -> None:
        from jsonschema import Draft202012Validator

        schemas = document["components"]["schemas"]
        self.validators = {name: Draft202012Validator(schemas[name]) for name in ("ChatRequest", "CompletionRequest")}

    def check(self, kind: str, body: dict[str, Any]) -> None:
        from jsonschema.exceptions import best_match

        error = best_match(self.validators[kind].iter_errors(body))
        if error is not None:
            where = ".".join(str(p) for p in error.absolute_path)
            raise InvalidPromptError(f"invalid request: {error.message}" + (f" at {where}" if where else ""))


def as_json_type(name: str, value: Any) -> Any:
    """A setting's value as its type: JSON Schema counts 3.0 as an integer, and fly's settings take it as 3."""
    rule = _RULES.get(name, {})
    integer = "integer" in (rule.get("type") if isinstance(rule.get("type"), list) else [rule.get("type")])
    return int(value) if integer and isinstance(value, float) and value.is_integer() else value


def limit_max_tokens(document: dict[str, Any], context_window: int) -> None:
    """State the server's budget: max_tokens up to half its context window (the prompt needs the rest)."""
    for name in ("ChatRequest", "CompletionRequest"):
        properties = document["components"]["schemas"][name]["properties"]
        for field in ("max_tokens", "max_completion_tokens", *(a for a, name in ALIASES.items() if name == "max_tokens")):
            if field in properties:
                properties[field] = {"anyOf": [{"type": "integer", "minimum": 1, "maximum": context_window // 2},
                                               {"type": "null"}], "title": field}


def request_schema(schema: dict[str, Any]) -> None:
    """Pydantic's schema of a request model, completed: fly's settings and the ignored fields as properties, and
    nothing else allowed (an unknown field is answered 400)."""
    properties = schema.setdefault("properties", {})
    properties.update({name: dict(rule, title=name) for name, rule in FLY_SETTINGS.items()})
    properties.update({alias: dict(_RULES[name], title=alias) for alias, name in ALIASES.items()})
    properties.update({name: {"title": name} for name in IGNORED})
    properties.update({name: dict(rule, title=name) for name, rule in UNSUPPORTED.items()})
    schema["additionalProperties"] = False

"""Chat messages as fly reads them, whoever sends them: LangChain's and LlamaIndex's message objects and the
OpenAI messages `fly serve` receives all become the same dicts here, by one set of rules (role names, tool
calls and their arguments, tool results), tool_choice is spelled once for each side, a response_format is
read by one rule, and a reply's usage is counted once.

Each caller only takes the text out of its own content blocks, which differ by framework."""

from __future__ import annotations

from typing import Any

from fly_integrations.tool_calls import arguments_of
from fly_runtime.errors import InvalidPromptError

# other frameworks' and APIs' names for the chat roles fly's templates know (system, user, assistant, tool)
ROLE_NAMES = {"human": "user", "ai": "assistant", "model": "assistant", "chatbot": "assistant",
              "developer": "system", "function": "tool"}


def chat_message(role: str, content: str, *, tool_calls: list[dict[str, Any]] | None = None,
                 tool_call_id: str | None = None, name: str | None = None) -> dict[str, Any]:
    """One chat message. ``tool_calls``: the calls an assistant message made, each ``{"id", "name",
    "arguments"}`` (arguments as an object or as the text the model wrote); another role's are not read."""
    role = ROLE_NAMES.get(role, role)
    message: dict[str, Any] = {"role": role, "content": content}
    if role == "assistant" and tool_calls:
        message["tool_calls"] = [
            {"type": "function", "id": call.get("id"),
             "function": {"name": call["name"], "arguments": call_arguments(call.get("arguments"))}}
            for call in tool_calls]
    if tool_call_id is not None:
        message["tool_call_id"] = tool_call_id
    if name is not None:
        message["name"] = name
    return message


def call_arguments(arguments: Any) -> dict[str, Any] | str:
    """A call's arguments as an object. Text that is no JSON object stays the text the model wrote: OpenAI's API
    takes any text there, and a malformed call in the history is still what the model said."""
    parsed = arguments_of(arguments)
    return parsed if isinstance(parsed, dict) else arguments


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


def usage(stats: Any) -> dict[str, Any]:
    """A reply's token counts under OpenAI's names, as `fly serve` returns them and LlamaIndex's
    TokenCountingHandler reads them; ``cached_tokens``: prompt tokens read from the cache, not again."""
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.new_tokens,
            "total_tokens": stats.prompt_tokens + stats.new_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}


def response_schema(response_format: dict[str, Any] | None) -> dict[str, Any] | None:
    """OpenAI's response_format as the schema a reply is decoded under: None for text (or none given), {} for
    any JSON object, the ``json_schema`` block's ``schema`` (any object where it has none)."""
    if not response_format or response_format.get("type") == "text":
        return None
    if response_format.get("type") == "json_object":
        return {}
    if response_format.get("type") == "json_schema":
        spec = response_format.get("json_schema") or {}
        return spec.get("schema", {})
    raise InvalidPromptError(f"response_format type must be text, json_object or json_schema, got "
                             f"{response_format.get('type')!r}")


def format_schema(fmt: str | dict[str, Any] | None) -> dict[str, Any] | None:
    """Ollama's ``format`` (ChatOllama's too) as the schema a reply is decoded under: "json" any JSON object, a
    dict that JSON schema, None or "" plain text."""
    if fmt in (None, ""):
        return None
    if fmt == "json":
        return {}
    if isinstance(fmt, dict):
        return fmt
    raise InvalidPromptError(f"format must be 'json' or a JSON schema (a dict), got {fmt!r}")

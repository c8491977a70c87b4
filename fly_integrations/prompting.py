"""Chat messages -> prompt token ids through the target's chat template, with tools and tool-choice steering.

Messages use the OpenAI-style dicts that chat templates expect: ``{"role", "content"}``, assistant
``tool_calls`` as ``{"type": "function", "function": {"name", "arguments"}}``, tool results as role
``tool``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from jinja2 import TemplateError

from fly_runtime.chat import chat_encoder
from fly_runtime.errors import InvalidPromptError
from fly_integrations.tool_calls import HERMES, ToolFormat, tool_format

ROLES = ("system", "user", "assistant", "tool")


class TemplateRefused(InvalidPromptError):
    """The chat template raised on the messages (its own rules, such as the order of roles)."""


@dataclass(frozen=True)
class Prompt:
    token_ids: list[int]
    prefill: str  # text already placed in the assistant turn; it belongs to the reply
    stop: tuple[str, ...]  # stops the steering adds (one forced call ends at its closing tag)
    tool_format: ToolFormat | None = None  # how the model writes its calls; None where no tools are offered


def check_messages(messages: list[dict]) -> None:
    if not messages:
        raise InvalidPromptError("the message list is empty: pass at least one message")
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ROLES:
            raise InvalidPromptError(f"message {i} has unknown role {role!r}; use one of {', '.join(ROLES)}")
        if not isinstance(message.get("content", ""), str):
            raise InvalidPromptError(
                f"message {i} content must be text, got {type(message['content']).__name__}: "
                "this model reads text only (no images, audio or files)"
            )
    if not any((m.get("content") or "").strip() or m.get("tool_calls") for m in messages):
        raise InvalidPromptError("every message is empty or whitespace: give the model something to answer")


def tool_choice_prefill(tool_choice: str | None, tool_names: list[str], fmt: ToolFormat = HERMES) -> str:
    """Assistant-turn text that opens a call in the family's format where ``tool_choice`` forces one: ``any`` opens
    a call, a name also fixes the tool; the rest is decoded under the tools' schemas (``ToolFormat.forced_grammar``)."""
    if not tool_names or tool_choice in (None, "auto", "none"):
        return ""
    if tool_choice in ("any", "required"):
        return fmt.prefill()
    if tool_choice in tool_names:
        return fmt.prefill(tool_choice)
    raise InvalidPromptError(
        f"tool_choice {tool_choice!r} names no bound tool; bound tools: {', '.join(tool_names)} "
        "(or use 'auto', 'any', 'none')"
    )


def render_prompt(
    tokenizer,
    messages: list[dict],
    tools: list[dict] | None = None,
    tool_choice: str | None = None,
    json_schema: dict | None = None,
) -> Prompt:
    """Token ids for the target, with tools rendered by the template and the reply steered as asked. Message
    contents (and tool schemas) are encoded as text: a control-token spelling in them stays text."""
    check_messages(messages)
    tools = tools if tools and tool_choice != "none" else None
    fmt = tool_format(tokenizer) if tools else None
    if tools and fmt is None:
        raise InvalidPromptError("this model's chat template renders no tools, so it cannot call them: use a model "
                                 "trained for tool calling (Qwen2.5, Llama 3.1+, Mistral), or call without tools")
    names = [t["function"]["name"] for t in tools or []]
    prefill = tool_choice_prefill(tool_choice, names, fmt or HERMES)
    stop: tuple[str, ...] = (fmt.closing,) if prefill and fmt and fmt.closing else ()
    if json_schema is not None:
        instruction = "Reply with one JSON object and nothing else."
        if json_schema:
            instruction += " It must follow this JSON schema:\n" + json.dumps(json_schema, ensure_ascii=False)
        messages = _with_system_instruction(messages, instruction)  # the engine's grammar enforces it
    try:
        ids = chat_encoder(tokenizer).encode(messages, tools, suffix=prefill)
    except TemplateError as exc:  # the template's own rule (e.g. a role order it does not take): the caller's input
        raise TemplateRefused(f"the model's chat template refused these messages: {exc}") from None
    return Prompt(ids, prefill, stop, fmt)


def _with_system_instruction(messages: list[dict], instruction: str) -> list[dict]:
    if messages[0]["role"] == "system":
        first = dict(messages[0], content=f"{messages[0]['content']}\n\n{instruction}".strip())
        return [first, *messages[1:]]
    return [{"role": "system", "content": instruction}, *messages]

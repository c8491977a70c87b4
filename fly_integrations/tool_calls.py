"""Tool calls in model output: Qwen2.5's ``<tool_call>{"name", "arguments"}</tool_call>`` and a JSON fallback.

Framework-free; both adapters turn the parsed calls into their own message types. A ``<tool_call>`` block that
does not parse comes back as an ``InvalidToolCall`` with the reason (LangChain's ``invalid_tool_calls``), never
as the reply's text; bare JSON that is not a call of a bound tool stays text. Nothing here raises.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from fly_runtime.text import partial_marker_length

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class InvalidToolCall:
    text: str  # the call as the model wrote it, markers included
    error: str  # why it is not a call
    name: str | None = None
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


@dataclass
class ParsedReply:
    content: str
    calls: list[ToolCall]
    invalid: list[InvalidToolCall] = field(default_factory=list)


def _call_from_json(obj: object, known: set[str] | None) -> ToolCall | str:
    """The call, or why ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'not a JSON object with a "name" string'
    if known is not None and obj["name"] not in known:
        return f"no tool named {obj['name']!r} is bound (bound: {', '.join(sorted(known))})"
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            return f"the arguments string is not JSON: {exc}"
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return f"the arguments are a {type(args).__name__}, not a JSON object"
    return ToolCall(obj["name"], args)


def _load_json(text: str) -> object:
    """The JSON value of ``text``, or a ``json.JSONDecodeError`` saying why it has none."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        # models sometimes close the object one brace too many; accept the first complete value
        try:
            value, _ = json.JSONDecoder().raw_decode(text)
            return value
        except json.JSONDecodeError:
            return exc


def parse_tool_calls(text: str, known: set[str] | None = None) -> ParsedReply:
    """Split ``text`` into its prose, its tool calls and the calls that do not parse. ``known`` limits calls to
    bound tool names."""
    if OPEN in text:
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        for match in _BLOCK.finditer(text):
            value = _load_json(match.group(1))
            call = f"not JSON: {value}" if isinstance(value, json.JSONDecodeError) else _call_from_json(value, known)
            if isinstance(call, ToolCall):
                calls.append(call)
            else:
                named = _NAME.search(match.group(1))  # the name where the JSON around it is broken
                name = named.group(1) if named else None
                invalid.append(InvalidToolCall(match.group(0), call, name))
        return ParsedReply(_BLOCK.sub("", text).strip(), calls, invalid)
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    candidate = fenced.group(1) if fenced else stripped
    if candidate.startswith(("{", "[")):
        value = _load_json(candidate)
        items = value if isinstance(value, list) else [value]
        parsed = [_call_from_json(item, known) for item in items]
        if parsed and all(isinstance(p, ToolCall) for p in parsed):
            return ParsedReply("", parsed)  # type: ignore[arg-type]
    return ParsedReply(stripped, [])


class ReplySplitter:
    """Streams a reply as prose until it may be a tool call, then holds it back to be parsed at the end.

    ``prefill`` is reply text placed in the prompt by tool-choice steering or JSON mode; it belongs to
    the reply. With ``parse_tools`` False everything streams as prose.
    """

    def __init__(self, prefill: str = "", parse_tools: bool = False, known: set[str] | None = None) -> None:
        self.text = prefill
        self.parse_tools = parse_tools
        self.known = known
        self.emitted = ""
        self._holding = parse_tools and bool(prefill)  # a forced call is a call from its first token

    def push(self, piece: str) -> str:
        """Add generated text; return the prose that is safe to show now."""
        self.text += piece
        if not self.parse_tools:
            return self._emit_until(len(self.text))
        if self._holding:
            return ""
        head = self.text.lstrip()
        if head[:1] in ("{", "[") or head.startswith("`"):
            self._holding = True  # may be a bare JSON call: decide at the end
            return ""
        at = self.text.find(OPEN)
        if at >= 0:
            self._holding = True
            return self._emit_until(at)
        return self._emit_until(len(self.text) - partial_marker_length(self.text, (OPEN,)))

    def finish(self) -> ParsedReply:
        """The prose not yet shown, and the tool calls (valid and not) of the whole reply."""
        if not self.parse_tools:
            return ParsedReply(self._emit_until(len(self.text)), [])
        parsed = parse_tool_calls(self.text, self.known)
        content = parsed.content
        if content.startswith(self.emitted):
            rest = content[len(self.emitted) :]
        else:
            rest = content[len(self.emitted.strip()):] if content.startswith(self.emitted.strip()) else ""
        self.emitted += rest
        return ParsedReply(rest, parsed.calls, parsed.invalid)

    def _emit_until(self, end: int) -> str:
        if end <= len(self.emitted):
            return ""
        delta = self.text[len(self.emitted) : end]
        self.emitted = self.text[:end]
        return delta

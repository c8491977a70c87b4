"""Tool calls in model output: Qwen2.5's ``<tool_call>{"name", "arguments"}</tool_call>`` and a JSON fallback.

Framework-free; both adapters turn the parsed calls into their own message types. Output that is not a
valid tool call stays text: a malformed call never raises.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)


@dataclass
class ToolCall:
    name: str
    arguments: dict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")


def _call_from_json(obj: object, known: set[str] | None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if known is not None and obj["name"] not in known:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return None
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], args)


def _load_json(text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        # models sometimes close the object one brace too many or too few; accept the first complete value
        try:
            value, _ = json.JSONDecoder().raw_decode(text)
            return value
        except json.JSONDecodeError:
            return None


def parse_tool_calls(text: str, known: set[str] | None = None) -> tuple[str, list[ToolCall]]:
    """Split ``text`` into its prose and its tool calls. ``known`` limits calls to bound tool names."""
    calls: list[ToolCall] = []
    if OPEN in text:
        for block in _BLOCK.findall(text):
            call = _call_from_json(_load_json(block), known)
            if call is None:
                return text.strip(), []  # a malformed call: hand the text back untouched
            calls.append(call)
        return _BLOCK.sub("", text).strip(), calls
    stripped = text.strip()
    fenced = _FENCE.match(stripped)
    candidate = fenced.group(1) if fenced else stripped
    if candidate.startswith(("{", "[")):
        value = _load_json(candidate)
        items = value if isinstance(value, list) else [value]
        parsed = [_call_from_json(item, known) for item in items]
        if parsed and all(parsed):
            return "", parsed  # type: ignore[return-value]
    return stripped, []


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
        return self._emit_until(len(self.text) - _partial_tag_length(self.text))

    def finish(self) -> tuple[str, list[ToolCall]]:
        """The prose not yet shown, and the tool calls of the whole reply."""
        if not self.parse_tools:
            return self._emit_until(len(self.text)), []
        content, calls = parse_tool_calls(self.text, self.known)
        if content.startswith(self.emitted):
            rest = content[len(self.emitted) :]
        else:
            rest = content[len(self.emitted.strip()):] if content.startswith(self.emitted.strip()) else ""
        self.emitted += rest
        return rest, calls

    def _emit_until(self, end: int) -> str:
        if end <= len(self.emitted):
            return ""
        delta = self.text[len(self.emitted) : end]
        self.emitted = self.text[:end]
        return delta


def _partial_tag_length(text: str) -> int:
    """Length of the longest suffix of ``text`` that could grow into ``<tool_call>``."""
    for n in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:n]):
            return n
    return 0

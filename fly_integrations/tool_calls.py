"""Tool calls in model output, by model family, chosen from the target's chat template:

- ``hermes`` (Qwen2.5, Hermes): ``<tool_call>{"name", "arguments"}</tool_call>`` blocks;
- ``llama3`` (Llama 3.1+): bare ``{"name", "parameters"}`` objects (after ``<|python_tag|>``, a control token
  the decoded reply drops), several separated by ``;``;
- ``mistral``: ``[TOOL_CALLS]`` and a JSON array of ``{"name", "arguments"}``;
- ``json``: a template that renders tools in a format not listed: bare JSON calls.

Framework-free; both adapters turn the parsed calls into their own message types. A call that does not parse
comes back as an ``InvalidToolCall`` with the reason (LangChain's ``invalid_tool_calls``), never as the reply's
text; bare JSON that names no tool stays text. Nothing here raises.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass, field

from fly_integrations.tools import closed_schema
from fly_runtime.constraint import TRAILING, laid_out
from fly_runtime.text import partial_marker_length

_NAME = re.compile(r'"name"\s*:\s*"([^"]+)"')
_FENCE = re.compile(r"^```(?:json)?\s*(.*?)\s*```$", re.S)
_SEPARATORS = re.compile(r"[\s;,]*")


@dataclass(frozen=True)
class ToolFormat:
    name: str
    marker: str | None  # text that opens a call in the reply; None: a call is bare JSON at the reply's start
    closing: str | None  # text that ends a call (a forced call stops there); None: the reply's end
    arguments_key: str  # what the family names a call's arguments
    span: tuple[str, str]  # (opening, closing) as decoded with control tokens: FLy verifies calls exactly there
    lead: str | None = None  # a control token that may come before the calls (dropped from streamed text)
    opening: str = '{"name": "'  # how a call starts, up to its tool's name
    brackets: str = "}"  # what closes a call's JSON after its arguments

    @property
    def blocks(self) -> bool:
        """Calls are blocks between an opening and a closing tag, each parsed alone, with prose around them;
        otherwise the calls are the whole reply (a JSON object or list)."""
        return self.marker is not None and self.closing is not None

    def prefill(self, name: str | None = None) -> str:
        """Assistant text that opens a forced call (of the named tool: up to its arguments), so that the tokens a
        caller's budget pays for are the ones the model chooses; the rest is decoded under ``forced_grammar``."""
        return self.opening if name is None else f'{self.opening}{name}", "{self.arguments_key}": '

    def forced_grammar(self, parameters: dict[str, dict], name: str | None = None) -> str:
        """The rest of a forced call after ``prefill(name)`` as a grammar (llguidance's Lark): the named tool's
        arguments under its parameter schema, or (no name) one of ``parameters``' tools by name and its arguments,
        then the brackets that close the call; the reply ends there (the parser does without a closing tag). The
        call then parses and follows its schema by construction."""
        tail = f'{json.dumps(self.brackets)} {TRAILING}'
        if name is not None:
            return f"start: args {tail}\nargs: %json {json.dumps(_object_schema(parameters[name]))}"
        rules = [f"start: {' | '.join(f'call{i}' for i in range(len(parameters)))}"]
        for i, (tool, schema) in enumerate(parameters.items()):
            lead = json.dumps(f'{tool}", "{self.arguments_key}": ')
            rules += [f"call{i}: {lead} args{i} {tail}", f"args{i}: %json {json.dumps(_object_schema(schema))}"]
        return "\n".join(rules)


def _object_schema(parameters: dict) -> dict:
    """A tool's parameters as the schema its arguments are decoded under: an object, closed where it lists its
    properties (tools.closed_schema's rule), in fly's JSON layout (the one the model writes its calls in)."""
    return laid_out(closed_schema(parameters) if parameters.get("properties") else {"type": "object"})


HERMES = ToolFormat("hermes", "<tool_call>", "</tool_call>", "arguments", ("<tool_call>", "</tool_call>"),
                    opening='<tool_call>\n{"name": "')
LLAMA3 = ToolFormat("llama3", None, None, "parameters", ('{"name"', "<|eot_id|>"), "<|python_tag|>")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", None, "arguments", ("[TOOL_CALLS]", "</s>"),
                     opening='[TOOL_CALLS][{"name": "', brackets="}]")
JSON_CALLS = ToolFormat("json", None, None, "arguments", ('{"name"', "\n\n\n"))
# the chat template text that tells each family
_SIGNS = ((HERMES, ("<tool_call>",)), (MISTRAL, ("[TOOL_CALLS]", "[AVAILABLE_TOOLS]")),
          (LLAMA3, ("<|python_tag|>", "ipython")))


def tool_format(tokenizer) -> ToolFormat | None:
    """The tool-call format of the target's chat template; None where the template renders no tools."""
    template = tokenizer.chat_template
    if isinstance(template, dict):  # several named templates: the one for tools, else the default
        template = template.get("tool_use") or template.get("default") or ""
    if not template:
        return None
    for fmt, signs in _SIGNS:
        if any(sign in template for sign in signs):
            return fmt
    return JSON_CALLS if _renders_tools(tokenizer) else None


def _renders_tools(tokenizer) -> bool:
    messages = [{"role": "user", "content": "hi"}]
    probe = [{"type": "function", "function": {"name": "probe_tool_7", "description": "", "parameters": {
        "type": "object", "properties": {}}}}]
    try:
        return "probe_tool_7" in tokenizer.apply_chat_template(messages, tools=probe, tokenize=False)
    except Exception:  # a template that fails on tools renders none
        return False


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


def arguments_of(value: object) -> dict | str:
    """A call's arguments as an object, however they came (an object, JSON text, nothing), or why they are not
    one: the one reading of argument text, for calls a model writes, a server streams and a history holds."""
    if isinstance(value, str):
        if not value.strip():
            return {}
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            return f"the arguments string is not JSON: {exc}"
    if value is None:
        return {}
    if not isinstance(value, dict):
        return f"the arguments are a {type(value).__name__}, not a JSON object"
    return value


def _call_from_json(obj: object, known: set[str] | None) -> ToolCall | str:
    """The call, or why ``obj`` is not one."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return 'not a JSON object with a "name" string'
    if known is not None and obj["name"] not in known:
        return f"no tool named {obj['name']!r} is bound (bound: {', '.join(sorted(known))})"
    args = arguments_of(obj.get("arguments", obj.get("parameters", {})))
    return ToolCall(obj["name"], args) if isinstance(args, dict) else args


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


def parse_tool_calls(text: str, known: set[str] | None = None, fmt: ToolFormat = HERMES) -> ParsedReply:
    """Split ``text`` into its prose, its tool calls and the calls that do not parse. ``known`` limits calls to
    bound tool names."""
    if fmt.blocks and fmt.marker in text:
        calls: list[ToolCall] = []
        invalid: list[InvalidToolCall] = []
        block = _block_pattern(fmt.marker, fmt.closing)
        for match in block.finditer(text):
            _add(match.group(1), match.group(0), known, calls, invalid)
        return ParsedReply(block.sub("", text).strip(), calls, invalid)
    stripped = text.strip()
    for lead in (fmt.marker, fmt.lead):
        if lead and stripped.startswith(lead):
            stripped = stripped[len(lead):].strip()
    fenced = _FENCE.match(stripped)
    candidate = fenced.group(1) if fenced else stripped
    if not candidate.startswith(("{", "[")):
        return ParsedReply(stripped, [])
    values = _json_values(candidate)
    if values is None:  # broken JSON: a call where it names one and the family writes calls this way
        if not fmt.blocks and (named := _NAME.search(candidate)):
            return ParsedReply("", [], [InvalidToolCall(text.strip(), "not JSON", named.group(1))])
        return ParsedReply(stripped, [])
    items = [item for value in values for item in (value if isinstance(value, list) else [value])]
    parsed = [_call_from_json(item, known) for item in items]
    if parsed and all(isinstance(p, ToolCall) for p in parsed):
        return ParsedReply("", parsed)  # type: ignore[arg-type]
    if not fmt.blocks and items and all(isinstance(i, dict) and "name" in i for i in items):
        invalid = [InvalidToolCall(json.dumps(item, ensure_ascii=False), result,
                                   item["name"] if isinstance(item["name"], str) else None)
                   for item, result in zip(items, parsed) if not isinstance(result, ToolCall)]
        return ParsedReply("", [p for p in parsed if isinstance(p, ToolCall)], invalid)
    return ParsedReply(stripped, [])  # JSON that names no tool is an answer, not a call


@functools.lru_cache(maxsize=8)
def _block_pattern(opening: str, closing: str) -> re.Pattern:
    """One call between its tags (an unclosed last one runs to the reply's end)."""
    return re.compile(rf"{re.escape(opening)}\s*(.*?)\s*(?:{re.escape(closing)}|$)", re.S)


def _add(body: str, written: str, known: set[str] | None, calls: list[ToolCall],
         invalid: list[InvalidToolCall]) -> None:
    """Parse one call's JSON ``body`` into ``calls``, or into ``invalid`` (as ``written``) with the reason."""
    value = _load_json(body)
    call = f"not JSON: {value}" if isinstance(value, json.JSONDecodeError) else _call_from_json(value, known)
    if isinstance(call, ToolCall):
        calls.append(call)
    else:
        named = _NAME.search(body)  # the name where the JSON around it is broken
        invalid.append(InvalidToolCall(written, call, named.group(1) if named else None))


def _json_values(text: str) -> list[object] | None:
    """The JSON values written one after another in ``text`` (separated by whitespace, ``;`` or ``,``, as
    Llama writes several calls), or None where any part is not JSON."""
    decoder, values, position = json.JSONDecoder(), [], 0
    while position < len(text):
        try:
            value, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)
        position = _SEPARATORS.match(text, position).end()
    return values


class ReplySplitter:
    """Streams a reply as prose until it may be a tool call, then holds it back to be parsed at the end.

    ``prefill`` is reply text placed in the prompt by tool-choice steering or JSON mode; it belongs to
    the reply. With ``parse_tools`` False everything streams as prose.
    """

    def __init__(self, prefill: str = "", parse_tools: bool = False, known: set[str] | None = None,
                 fmt: ToolFormat = HERMES) -> None:
        self.text = prefill
        self.parse_tools = parse_tools
        self.known = known
        self.fmt = fmt
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
        marker = self.fmt.marker
        if marker is None:
            return self._emit_until(len(self.text))
        at = self.text.find(marker)
        if at >= 0:
            self._holding = True
            return self._emit_until(at)
        return self._emit_until(len(self.text) - partial_marker_length(self.text, (marker,)))

    def finish(self) -> ParsedReply:
        """The prose not yet shown, and the tool calls (valid and not) of the whole reply."""
        if not self.parse_tools:
            return ParsedReply(self._emit_until(len(self.text)), [])
        parsed = parse_tool_calls(self.text, self.known, self.fmt)
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

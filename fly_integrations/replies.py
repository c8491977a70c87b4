"""One reply to a conversation: render, generate, split prose from tool calls. Shared by both adapters.

Yields text deltas as they become final, then one ``Reply``. A model that answers a tool result by
repeating a call already answered in the conversation (same tool, same arguments) learns nothing new
from it, so agent loops would not terminate: such a reply is replaced by a second generation, steered to
answer by an instruction after the conversation. That prompt starts exactly as the first did, so the engine
reads only the instruction again (dropping the tools instead changes the system prompt they are rendered
into, and the whole prompt is read anew). Where the model still repeats the call, a
third generation runs with tools off.
Where tools are bound, FLy verifies the model family's tool calls exactly.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace

from fly_integrations.messages import call_arguments
from fly_integrations.prompting import TemplateRefused, render_prompt
from fly_integrations.reasoning import Reasoning, ReasoningSplitter, opens_inside, thinks
from fly_integrations.tool_calls import HERMES, InvalidToolCall, ReplySplitter, ToolCall
from fly_integrations.tools import closed_schema, conform_arguments
from fly_runtime import FlyEngine, GenerationConfig, GenerationResult
from fly_runtime.engine import GenerationStats


@dataclass
class Reply:
    content: str
    tool_calls: list[ToolCall]
    result: GenerationResult
    invalid_tool_calls: list[InvalidToolCall] = field(default_factory=list)  # calls written but not parseable
    reasoning: str = ""  # a thinking model's reasoning (fly_integrations/reasoning.py), apart from content


@dataclass
class ReplyRequest:
    engine: FlyEngine
    messages: list[dict]
    # builds the request's config given the stops the prompt adds (a forced call ends at its closing tag)
    config: Callable[[tuple[str, ...]], GenerationConfig]
    tools: list[dict] | None = None
    tool_choice: str | None = None
    json_schema: dict | None = None

    @property
    def tool_names(self) -> set[str] | None:
        if not self.tools or self.tool_choice == "none":
            return None
        return {t["function"]["name"] for t in self.tools}

    def parameters_of(self, name: str) -> dict:
        """The JSON schema of the named tool's parameters (empty if no such tool is bound)."""
        for tool in self.tools or []:
            if tool["function"]["name"] == name:
                return tool["function"].get("parameters", {})
        return {}


# appended (as a system message) when the model repeats an answered call
ANSWER_NOW = "The tool results above hold what the request needs: answer it now in text, without calling a tool."


def _attempts(request: ReplyRequest) -> Iterator[tuple[list[dict], str | None]]:
    """The (messages, tool_choice) of each generation, in order: as asked; then, where the model repeated an
    answered call, steered to answer by an instruction appended to the same prompt; then without tools."""
    yield request.messages, request.tool_choice
    yield [*request.messages, {"role": "system", "content": ANSWER_NOW}], request.tool_choice
    yield request.messages, "none"


def stream_reply(request: ReplyRequest) -> Iterator[str | Reply]:
    """Text deltas (``Reasoning`` deltas first, for a thinking model), then the Reply. Where an attempt is
    replaced, what it already streamed stays part of the reply (a stream never shows text the final message
    lacks) and its tokens count in the reply's usage."""
    shown = ""  # streamed by attempts that were replaced
    thought = ""  # reasoning streamed by attempts that were replaced
    spent: GenerationStats | None = None
    for messages, choice in _attempts(request):
        try:
            prompt = render_prompt(request.engine.tokenizer, messages, request.tools, choice, request.json_schema)
        except TemplateRefused:
            if messages is request.messages:  # only the steering instruction is ours to drop
                raise
            continue  # the template takes no system message after the first
        fmt = prompt.tool_format  # chosen once, where the prompt was rendered
        splitter = ReplySplitter(prompt.prefill, fmt is not None, request.tool_names if fmt else None, fmt or HERMES)
        config = request.config(prompt.stop)
        if fmt is not None:  # a call's arguments must be the target's own, not a forgiven alternative
            config = replace(config, exact_spans=(fmt.span,))
        if request.json_schema is not None:  # decoded under the schema's grammar, verified exactly
            config = replace(config, json_schema=json.dumps(closed_schema(request.json_schema) or {"type": "object"}))
        elif prompt.prefill and fmt is not None:  # a forced call: the rest under the tools' schemas
            parameters = {name: request.parameters_of(name) for name in sorted(request.tool_names or ())}
            config = replace(config, grammar=fmt.forced_grammar(parameters, choice if choice in parameters else None))
        # free text may open with reasoning; a reply under a grammar is the grammar's from its first token
        tokenizer = request.engine.tokenizer
        thinking = (ReasoningSplitter(opens_inside(tokenizer, prompt.token_ids))
                    if config.json_schema is None and config.grammar is None and thinks(tokenizer) else None)
        with request.engine.stream(prompt.token_ids, config) as stream:
            for part in _read(stream, thinking):
                if isinstance(part, Reasoning):
                    yield part
                elif delta := splitter.push(part):
                    yield delta
        thought += thinking.reasoning if thinking else ""
        parsed = splitter.finish()
        rest, calls = parsed.content, parsed.calls
        for call in calls:
            call.arguments = conform_arguments(call.arguments, request.parameters_of(call.name))
        if rest:
            yield rest
        assert stream.result is not None
        spent = stream.result.stats if spent is None else spent + stream.result.stats
        if calls and choice in (None, "auto") and _all_answered(calls, request.messages):
            shown += splitter.emitted
            if shown and not shown[-1].isspace():  # the next attempt's text starts on a line of its own
                shown += "\n"
                yield "\n"
            continue
        yield Reply(shown + splitter.emitted, calls, replace(stream.result, stats=spent), parsed.invalid, thought)
        return


def _read(pieces: Iterator[str], thinking: ReasoningSplitter | None) -> Iterator[str]:
    """The generated pieces, with the reasoning split off where the model thinks."""
    if thinking is None:
        yield from pieces
        return
    for piece in pieces:
        yield from thinking.push(piece)
    yield from thinking.finish()


def reply(request: ReplyRequest) -> Reply:
    for item in stream_reply(request):
        if isinstance(item, Reply):
            return item
    raise AssertionError("stream_reply ended without a reply")


def _all_answered(calls: list[ToolCall], messages: list[dict]) -> bool:
    """Every call repeats one made earlier in the conversation and followed by its tool result."""
    answered: set[str] = set()
    last_calls: list[str] = []
    for m in messages:
        if m["role"] == "assistant":
            last_calls = [_key(c["function"]["name"], c["function"]["arguments"]) for c in m.get("tool_calls") or []]
        elif m["role"] == "tool":
            answered.update(last_calls)
    return bool(answered) and all(_key(c.name, c.arguments) in answered for c in calls)


def _key(name: str, arguments: object) -> str:
    return name + json.dumps(call_arguments(arguments), sort_keys=True, ensure_ascii=False)

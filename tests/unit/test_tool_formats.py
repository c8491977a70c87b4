"""Tool calls by model family, on what each family's chat template renders (small real tokenizers made here,
with chat templates written after each family's published format: Qwen2.5 / Hermes, Llama 3.1, Mistral)."""

import json

import pytest

from fly_integrations.prompting import render_prompt, tool_choice_prefill
from fly_integrations.tool_calls import HERMES, JSON_CALLS, LLAMA3, MISTRAL, ReplySplitter, parse_tool_calls, tool_format
from fly_runtime.errors import InvalidPromptError
from tests.unit.conftest import CHATML, bpe_tokenizer

HERMES_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n# Tools\n<tools>{% for t in tools %}\n{{ t | tojson }}{% endfor %}\n</tools>\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    "XML tags<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}<|im_start|>assistant\n"
    "{% for c in m.tool_calls %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% if not loop.last %}\n{% endif %}{% endfor %}<|im_end|>\n"
    "{% elif m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LLAMA_TEMPLATE = (
    "<|begin_of_text|>{% if tools %}<|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n"
    "Respond to a function call with JSON {\"name\": function name, \"parameters\": dictionary of arguments}.\n"
    "{% for t in tools %}{{ t | tojson }}\n{% endfor %}<|eot_id|>{% endif %}"
    "{% for m in messages %}{% if m.role == 'assistant' and m.tool_calls %}"
    "<|start_header_id|>assistant<|end_header_id|>\n\n<|python_tag|>{% for c in m.tool_calls %}"
    "{\"name\": \"{{ c.function.name }}\", \"parameters\": {{ c.function.arguments | tojson }}}"
    "{% if not loop.last %}; {% endif %}{% endfor %}<|eom_id|>"
    "{% elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>\n\n{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>\n\n{{ m.content }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}")
MISTRAL_TEMPLATE = (
    "<s>{% for m in messages %}{% if m.role == 'user' %}{% if loop.last and tools %}[AVAILABLE_TOOLS]"
    "{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}[INST]{{ m.content }}[/INST]"
    "{% elif m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS]"
    "{{ m.tool_calls | map(attribute='function') | list | tojson }}</s>"
    "{% elif m.role == 'tool' %}[TOOL_RESULTS]{\"content\": {{ m.content | tojson }}}[/TOOL_RESULTS]"
    "{% else %}{{ m.content }}</s>{% endif %}{% endfor %}")

FAMILIES = {
    "hermes": (HERMES, bpe_tokenizer(["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"],
                                     HERMES_TEMPLATE)),
    "llama3": (LLAMA3, bpe_tokenizer(["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                                      "<|eom_id|>", "<|python_tag|>"], [], LLAMA_TEMPLATE)),
    "mistral": (MISTRAL, bpe_tokenizer(["<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                                        "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"], [],
                                       MISTRAL_TEMPLATE)),
}
TOOLS = [{"type": "function", "function": {"name": name, "description": "", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for name in ("get_weather", "get_time")]
CALLS = [("get_weather", {"city": "Oslo"}), ("get_time", {"city": "Lima"})]
CONVERSATION = [
    {"role": "user", "content": "Weather and time in Oslo and Lima?"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": f"c{i}", "function": {"name": n, "arguments": a}} for i, (n, a) in enumerate(CALLS)]},
]
# where each family's rendered assistant turn with the calls begins and ends
TURN = {"hermes": ("<|im_start|>assistant\n", "<|im_end|>"),
        "llama3": ("<|start_header_id|>assistant<|end_header_id|>\n\n", "<|eom_id|>"),
        "mistral": ("[/INST]", "</s>")}


def rendered_calls(family: str, skip_control: bool) -> str:
    """The assistant turn with the calls as the family's template renders it, decoded as the engine streams a
    reply (control tokens dropped) or as its exact spans see it (kept)."""
    fmt, tok = FAMILIES[family]
    ids = tok.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=True)
    text = tok.decode(ids, skip_special_tokens=False)
    start, end = TURN[family]
    turn = text[text.rindex(start) + len(start):text.rindex(end)]
    return tok.decode(tok.encode(turn, add_special_tokens=False), skip_special_tokens=skip_control)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_family_is_told_from_its_template(family):
    fmt, tok = FAMILIES[family]
    assert tool_format(tok) is fmt


def test_a_template_that_renders_tools_otherwise_gets_bare_json_and_one_that_ignores_them_none():
    assert tool_format(bpe_tokenizer(["<|im_start|>", "<|im_end|>"], [], CHATML)) is JSON_CALLS
    plain = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    no_tools = bpe_tokenizer(["<|im_start|>", "<|im_end|>"], [], plain)
    assert tool_format(no_tools) is None
    with pytest.raises(InvalidPromptError, match="renders no tools"):
        render_prompt(no_tools, [{"role": "user", "content": "hi"}], TOOLS, "auto")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_parses_the_calls_its_template_renders(family):
    fmt = FAMILIES[family][0]
    for skip_control in (True, False):  # as streamed (control tokens dropped) and with them
        parsed = parse_tool_calls(rendered_calls(family, skip_control), {"get_weather", "get_time"}, fmt)
        assert [(c.name, c.arguments) for c in parsed.calls] == CALLS and not parsed.invalid
        assert parsed.content == ""


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_reports_a_broken_call_as_invalid(family):
    fmt = FAMILIES[family][0]
    broken = rendered_calls(family, True).replace('"Lima"}', '"Lima"', 1)
    parsed = parse_tool_calls(broken, {"get_weather", "get_time"}, fmt)
    assert parsed.invalid and parsed.invalid[0].error and not parsed.content
    assert parsed.invalid[-1].name in ("get_weather", "get_time")


@pytest.mark.parametrize("family", FAMILIES)
def test_each_family_streams_prose_and_holds_its_calls(family):
    fmt = FAMILIES[family][0]
    splitter = ReplySplitter(parse_tools=True, known={"get_weather", "get_time"}, fmt=fmt)
    text = rendered_calls(family, True)
    shown = "".join(splitter.push(text[i:i + 5]) for i in range(0, len(text), 5))
    assert shown == ""  # a call from its first character: nothing of it is shown as prose
    assert [c.name for c in splitter.finish().calls] == ["get_weather", "get_time"]
    answer = ReplySplitter(parse_tools=True, known={"get_weather"}, fmt=fmt)
    assert answer.push("It is sunny in Oslo.") + answer.finish().content == "It is sunny in Oslo."


@pytest.mark.parametrize("family", FAMILIES)
def test_tool_choice_opens_a_call_in_the_familys_format(family):
    fmt, tok = FAMILIES[family]
    forced = tool_choice_prefill("get_time", ["get_weather", "get_time"], fmt)
    rest = '{"city": "Lima"}}' + ("]" if fmt is MISTRAL else "")  # where the grammar ends: no closing tag
    parsed = parse_tool_calls(tok.decode(tok.encode(forced + rest, add_special_tokens=False), skip_special_tokens=True),
                              {"get_weather", "get_time"}, fmt)
    assert [(c.name, c.arguments) for c in parsed.calls] == [CALLS[1]]
    # the forced call's grammar takes exactly that rest, and neither another tool nor arguments outside its schema
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert _grammar_takes(fmt.forced_grammar(parameters, "get_time"), rest, tok)
    assert not _grammar_takes(fmt.forced_grammar(parameters, "get_time"), rest.replace("city", "town"), tok)
    named = 'get_time", "' + fmt.arguments_key + '": '
    assert _grammar_takes(fmt.forced_grammar(parameters), named + rest, tok)  # "any": one of the tools
    assert not _grammar_takes(fmt.forced_grammar(parameters), named.replace("time", "date") + rest, tok)


def test_calls_and_json_replies_are_written_in_one_layout_whose_separators_the_grammar_forces():
    """Arguments and JSON replies follow json.dumps's layout: the same value indented is refused, so every brace,
    key and separator is a token the grammar forces; a schema's own llguidance options ("x-guidance") win."""
    from fly_runtime.constraint import JsonConstraint, grammar_tokenizer

    fmt, tok = FAMILIES["hermes"]
    parameters = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
    assert _grammar_takes(fmt.forced_grammar(parameters, "get_time"), '{"city": "Lima"}}', tok)
    assert not _grammar_takes(fmt.forced_grammar(parameters, "get_time"), '{\n  "city": "Lima"\n}}', tok)
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    grammar = grammar_tokenizer(tok, len(tok), [tok.eos_token_id or 0])

    def takes(text: str, schema: dict) -> bool:
        constraint = JsonConstraint(grammar, json.dumps(schema), len(tok), [tok.eos_token_id or 0])
        return constraint.matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and \
            constraint.matcher.is_accepting()

    assert takes('{"city": "Lima", "days": 3}', schema)
    assert not takes('{\n  "city": "Lima",\n  "days": 3\n}', schema)
    assert not takes('{"city":"Lima","days":3}', schema)
    forced = JsonConstraint(grammar, json.dumps(schema), len(tok), [tok.eos_token_id or 0]).forced()
    assert tok.decode(forced).startswith('{"city')  # the opening and the first key before any choice
    flexible = dict(schema, **{"x-guidance": {"whitespace_flexible": True}})
    assert takes('{\n  "city": "Lima",\n  "days": 3\n}', flexible)


def test_the_grammars_forced_text_is_drafted_through_a_values_opening_quote():
    """The text a grammar forces goes on past its forced tokens: `{"city": "` holds a string's opening quote,
    which no token is forced for (the model may merge it with the value), but which is drafted, so the pass that
    reads a key also writes the value's first token. What is drafted is verified, never committed unread."""
    from fly_runtime.constraint import JsonConstraint, grammar_tokenizer

    _, tok = FAMILIES["hermes"]
    schema = {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
              "required": ["city", "days"], "additionalProperties": False}
    eos = [tok.eos_token_id or 0]
    constraint = JsonConstraint(grammar_tokenizer(tok, len(tok), eos), json.dumps(schema), len(tok), eos)
    forced = constraint.forced()
    assert tok.decode(forced) == '{"city": "'
    masks, allowed = constraint.masks_along(forced)
    assert allowed == len(forced)  # the grammar takes all of it
    constraint.commit(forced + tok.encode('Lima",', add_special_tokens=False))
    assert tok.decode(constraint.forced()) == ' "days": '  # an integer's separator, up to its first digit


def _grammar_takes(lark: str, text: str, tok) -> bool:
    """Does the grammar accept ``text`` whole, as ``tok`` tokenizes it?"""
    import llguidance
    import llguidance.hf

    grammar = llguidance.LLMatcher.grammar_from_lark(lark)
    matcher = llguidance.LLMatcher(llguidance.hf.from_tokenizer(tok, n_vocab=len(tok)), grammar, log_level=0)
    return matcher.consume_tokens(tok.encode(text, add_special_tokens=False)) and matcher.is_accepting()
    prompt = render_prompt(tok, CONVERSATION[:1], TOOLS, "any")
    assert prompt.prefill == fmt.prefill() and tok.decode(prompt.token_ids).endswith(fmt.prefill())

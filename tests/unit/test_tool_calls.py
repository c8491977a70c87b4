"""Tool-call parsing, streaming split and the repeated-call guard (no model needed)."""

from fly_integrations.prompting import tool_choice_prefill
from fly_integrations.replies import _all_answered
from fly_integrations.tool_calls import ReplySplitter, ToolCall, parse_tool_calls

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def test_parses_qwen_tool_calls_and_keeps_prose():
    parsed = parse_tool_calls("Let me check.\n" + CALL, {"get_weather"})
    content, calls = parsed.content, parsed.calls
    assert content == "Let me check."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert calls[0].id.startswith("call_")


def test_parses_json_fallbacks():
    for text in ('{"name": "get_weather", "arguments": {"city": "Oslo"}}',
                 '```json\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Oslo\\"}"}\n```'):
        parsed = parse_tool_calls(text, {"get_weather"})
        assert parsed.content == "" and parsed.calls[0].arguments == {"city": "Oslo"}


def test_a_malformed_or_unknown_call_is_reported_invalid_with_its_reason():
    broken = CALL.replace("}}", "}")
    parsed = parse_tool_calls("Checking.\n" + broken, {"get_weather"})
    assert parsed.content == "Checking." and parsed.calls == []
    [invalid] = parsed.invalid
    assert invalid.text == broken and "not JSON" in invalid.error
    good_and_unknown = parse_tool_calls(CALL + "\n" + CALL.replace("get_weather", "launch"), {"get_weather"})
    assert [c.name for c in good_and_unknown.calls] == ["get_weather"]
    assert good_and_unknown.invalid[0].name == "launch" and "no tool named 'launch'" in good_and_unknown.invalid[0].error
    not_a_call = parse_tool_calls('{"answer": 42}', {"get_weather"})  # bare JSON that is no call stays text
    assert (not_a_call.content, not_a_call.calls, not_a_call.invalid) == ('{"answer": 42}', [], [])


def test_splitter_streams_prose_and_holds_the_call():
    splitter = ReplySplitter(parse_tools=True, known={"get_weather"})
    shown = "".join(splitter.push(p) for p in ["Let me ", "check. <tool", "_call>\n{\"name\": \"get_weather\", ",
                                                 "\"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>"])
    assert shown == "Let me check. "
    parsed = splitter.finish()
    assert parsed.content == "" and parsed.calls[0].name == "get_weather"


def test_splitter_releases_a_partial_tag_that_was_not_a_call():
    splitter = ReplySplitter(parse_tools=True, known={"f"})
    assert splitter.push("a < b and <tool") == "a < b and "
    assert splitter.push("s are fine") == "<tools are fine"


def test_forced_prefills_open_the_call():
    assert tool_choice_prefill("any", ["f"]) == '<tool_call>\n{"name": "'
    assert tool_choice_prefill("f", ["f"]).endswith('"arguments": ')  # the grammar takes the arguments from there
    assert tool_choice_prefill("auto", ["f"]) == ""


def test_repeated_answered_call_is_detected():
    history = [
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "id": "1", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "1"},
    ]
    assert _all_answered([ToolCall("get_weather", {"city": "Oslo"})], history)
    assert not _all_answered([ToolCall("get_weather", {"city": "Rome"})], history)
    assert not _all_answered([ToolCall("get_weather", {"city": "Oslo"})], history[:2])  # no result yet


def test_quoted_numbers_and_booleans_take_the_types_the_tool_declares():
    from fly_integrations.tools import conform_arguments

    parameters = {"type": "object", "properties": {
        "a": {"type": "integer"}, "rate": {"type": "number"}, "exact": {"type": "boolean"},
        "zip": {"type": "string"}, "limit": {"type": ["integer", "null"]}}}
    written = {"a": "1234", "rate": "2.5", "exact": "true", "zip": "0150", "limit": " 7 ", "extra": "3"}
    assert conform_arguments(written, parameters) == {
        "a": 1234, "rate": 2.5, "exact": True, "zip": "0150", "limit": 7, "extra": "3"}
    # what does not read as the declared type is passed on as written, for the tool to judge
    assert conform_arguments({"a": "12 apples", "exact": "yes"}, parameters) == {"a": "12 apples", "exact": "yes"}
    assert written["a"] == "1234"  # the caller's dict is left as it was

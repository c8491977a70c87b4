"""One set of rules for chat messages: LangChain's and LlamaIndex's message objects and the OpenAI messages
`fly serve` receives become the same dicts (fly_integrations.messages)."""

from langchain_core.messages import AIMessage, ChatMessage, HumanMessage, SystemMessage, ToolMessage
from llama_index.core.base.llms.types import ChatMessage as LIMessage

from fly_integrations import langchain, llama_index, messages
from fly_integrations.server import protocol


def test_one_conversation_becomes_the_same_dicts_from_every_caller():
    openai = protocol.chat_messages([
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "4 C", "tool_call_id": "c1"},
    ])
    lc = [langchain._to_chat_dict(m, i) for i, m in enumerate([
        SystemMessage("Be brief."), HumanMessage("Weather in Oslo?"),
        AIMessage("", tool_calls=[{"id": "c1", "name": "weather", "args": {"city": "Oslo"}}]),
        ToolMessage("4 C", tool_call_id="c1")])]
    li = [llama_index._to_chat_dict(m, i) for i, m in enumerate([
        LIMessage(role="developer", content="Be brief."), LIMessage(role="user", content="Weather in Oslo?"),
        LIMessage(role="assistant", content="", additional_kwargs={"tool_calls": [
            {"id": "c1", "name": "weather", "arguments": '{"city": "Oslo"}'}]}),
        LIMessage(role="tool", content="4 C", additional_kwargs={"tool_call_id": "c1"})])]
    assert openai == lc == li
    assert openai[0] == {"role": "system", "content": "Be brief."}
    assert openai[2]["tool_calls"] == [{"type": "function", "id": "c1",
                                        "function": {"name": "weather", "arguments": {"city": "Oslo"}}}]


def test_role_names_and_call_arguments_follow_one_rule():
    assert langchain._to_chat_dict(ChatMessage(role="ai", content="hi"))["role"] == "assistant"
    assert llama_index._to_chat_dict(LIMessage(role="model", content="hi"), 0)["role"] == "assistant"
    assert messages.call_arguments('{"x": 1}') == {"x": 1}
    assert messages.call_arguments("") == {} and messages.call_arguments(None) == {}
    assert messages.call_arguments("{") == "{"  # what the model wrote, kept
    assert messages.call_arguments("[1]") == "[1]"  # JSON, but no object
    error = langchain._to_chat_dict(ToolMessage("boom", tool_call_id="c", status="error"))
    assert error == {"role": "tool", "content": "Error: boom", "tool_call_id": "c"}


def test_tool_choice_is_spelled_once_for_each_side():
    assert messages.tool_choice("required") == "any"
    assert messages.tool_choice({"type": "function", "function": {"name": "f"}}) == "f"
    assert messages.openai_tool_choice("any") == "required"
    assert messages.openai_tool_choice("f") == {"type": "function", "function": {"name": "f"}}
    for choice in ("auto", "none", "required", "f"):
        assert messages.tool_choice(messages.openai_tool_choice(choice)) in (choice, "any")


def test_usage_is_counted_once_under_openais_names_and_langchains():
    from fly_integrations.langchain import _usage
    from fly_integrations.messages import usage
    from fly_runtime import GenerationResult
    from fly_runtime.engine import GenerationStats

    stats = GenerationStats(prompt_tokens=40, cached_tokens=31, new_tokens=12)
    assert usage(stats) == {"prompt_tokens": 40, "completion_tokens": 12, "total_tokens": 52,
                            "prompt_tokens_details": {"cached_tokens": 31}}
    assert _usage(GenerationResult("text", [], "stop", stats)) == {
        "input_tokens": 40, "output_tokens": 12, "total_tokens": 52, "input_token_details": {"cache_read": 31}}


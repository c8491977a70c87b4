"""What the adapters make of a finished reply (no model): invalid tool calls, usage, the per-call model."""

import pytest
from langchain_core.language_models.chat_models import generate_from_stream
from llama_index.core.base.llms.types import ChatMessage, ChatResponse, MessageRole

from fly_integrations import FlyChatModel, FlyLLM
from fly_integrations.replies import Reply
from fly_integrations.tool_calls import parse_tool_calls
from fly_runtime.engine import GenerationResult, GenerationStats

BROKEN = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"\n</tool_call>'
GOOD = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'


def a_reply(text: str) -> Reply:
    parsed = parse_tool_calls(text, {"get_weather"})
    stats = GenerationStats(prompt_tokens=12, new_tokens=30, target_forwards=10, seconds=1.0)
    return Reply(parsed.content, parsed.calls, GenerationResult(parsed.content, [], "stop", stats, "qwen2.5-coder-0.5b-instruct"),
                 parsed.invalid)


def test_langchain_stream_files_a_broken_call_as_invalid_beside_the_good_one():
    model = FlyChatModel()
    done = a_reply("Checking.\n" + GOOD + "\n" + BROKEN)
    chunks = [model._chunk(done.content, None), model._chunk(done, "qwen2.5-coder-1.5b-instruct")]
    message = generate_from_stream(iter(chunks)).generations[0].message
    assert message.content == "Checking."
    assert [c["args"] for c in message.tool_calls] == [{"city": "Rome"}]
    assert [c["name"] for c in message.invalid_tool_calls] == ["get_weather"]
    assert message.invalid_tool_calls[0]["args"] == BROKEN
    assert message.usage_metadata["total_tokens"] == 42
    assert message.response_metadata["model_name"] == "qwen2.5-coder-1.5b-instruct"
    assert message.response_metadata["draft_model"] == "qwen2.5-coder-0.5b-instruct"


def test_llama_index_names_the_parse_error_when_a_call_was_required():
    llm = FlyLLM()
    response = llm._response(a_reply(BROKEN), "")
    with pytest.raises(ValueError, match="does not parse .*not JSON"):
        llm.get_tool_calls_from_response(response)
    assert llm.get_tool_calls_from_response(response, error_on_no_tool_call=False) == []
    assert response.raw["usage"] == {"prompt_tokens": 12, "completion_tokens": 30, "total_tokens": 42,
                                     "prompt_tokens_details": {"cached_tokens": 0}}  # the server's usage


def test_llama_index_a_text_answer_without_calls_is_still_an_error_when_one_was_required():
    llm = FlyLLM()
    response = ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content="It is sunny."))
    with pytest.raises(ValueError, match="expected at least one tool call"):
        llm.get_tool_calls_from_response(response)


def test_two_generations_of_one_reply_add_up_with_the_mean_draft_length_weighed_by_rounds():
    first = GenerationStats(prompt_tokens=50, new_tokens=100, target_forwards=40, rounds=30, mean_k=4.0, seconds=2.0)
    second = GenerationStats(prompt_tokens=60, new_tokens=10, target_forwards=11, rounds=10, mean_k=8.0, seconds=0.5)
    both = first + second
    assert (both.new_tokens, both.target_forwards, both.rounds, both.seconds) == (110, 51, 40, 2.5)
    assert both.mean_k == (30 * 4.0 + 10 * 8.0) / 40  # per round, not per token
    assert (GenerationStats() + GenerationStats()).mean_k == 0.0

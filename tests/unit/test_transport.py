"""An adapter's transport, chosen once at construction (no model, no server): the body a server is sent, and a
server's streamed chunks read back as the items the local engine yields."""

from openai.types.chat import ChatCompletionChunk

from fly_integrations import FlyChatModel, FlyLLM
from fly_integrations.reasoning import Reasoning
from fly_integrations.replies import Reply
from fly_integrations.transport import Local, Remote, _StreamReader


def test_each_adapter_picks_its_transport_once_and_a_copy_keeps_its_own_settings():
    assert isinstance(FlyChatModel()._transport, Local) and isinstance(FlyLLM()._transport, Local)
    remote = FlyChatModel(base_url="http://127.0.0.1:9/v1", api_key="k", temperature=0.3)
    assert isinstance(remote._transport, Remote) and isinstance(FlyLLM(base_url="http://h/v1")._transport, Remote)
    warmer = remote.model_copy(update={"temperature": 0.9})
    assert warmer._transport._body(warmer, warmer._call([], None, {}))["temperature"] == 0.9


def test_a_server_is_sent_openais_fields_and_flys_settings_as_extra_body():
    llm = FlyChatModel(base_url="http://127.0.0.1:9/v1", mode="exact", max_tokens=32, stop=["END"])
    history = [{"role": "user", "content": "Weather?"},
               {"role": "assistant", "content": "", "tool_calls": [
                   {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
               {"role": "tool", "content": "4 C", "tool_call_id": "c1"}]
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    call = llm._call([], None, {"tools": [tool], "tool_choice": "get_weather", "num_predict": 7, "k": 4})
    call.messages = history
    body = llm._transport._body(llm, call)
    assert body["model"] == "qwen2.5-coder-1.5b-instruct" and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True} and body["max_tokens"] == 7  # Ollama's name
    assert body["messages"][1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Oslo"}'
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["extra_body"]["mode"] == "exact" and body["extra_body"]["k"] == 4 and body["stop"] == ["END"]
    assert "max_tokens" not in body["extra_body"] and "temperature" not in body["extra_body"]
    assert "response_format" not in body
    as_json = FlyChatModel(base_url="http://h/v1", format="json")
    assert as_json._transport._body(as_json, as_json._call([], None, {}))["response_format"] == {"type": "json_object"}


def chunk(delta: dict, finish=None, usage=None, **extra) -> ChatCompletionChunk:
    choices = [{"index": 0, "delta": delta, "finish_reason": finish}] if delta is not None else []
    return ChatCompletionChunk.model_validate({"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m",
                                                "choices": choices, "usage": usage, **extra})


def test_a_servers_stream_reads_back_as_the_engines_items():
    reader = _StreamReader("m")
    stream = [chunk({"role": "assistant", "content": ""}), chunk({"reasoning_content": "Look it up."}),
              chunk({"content": "Checking."}),
              chunk({"tool_calls": [{"index": 0, "id": "c1", "type": "function",
                                     "function": {"name": "get_weather", "arguments": '{"ci'}}]}),
              chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]}),
              chunk({"tool_calls": [{"index": 1, "id": "c2", "function": {"name": "get_weather", "arguments": "{"}}]}),
              chunk({}, finish="tool_calls"),
              chunk(None, usage={"prompt_tokens": 50, "completion_tokens": 20, "total_tokens": 70,
                                 "prompt_tokens_details": {"cached_tokens": 30}},
                    fly={"mode": "exact", "mean_accepted": 2.0, "fly_forgiven": 1, "cached_tokens": 30,
                         "tokens_per_second": 10.0, "draft_model": "qwen2.5-coder-0.5b-instruct"})]
    items = [item for c in stream for item in reader.read(c)] + [reader.reply()]
    assert items[:2] == ["Look it up.", "Checking."] and isinstance(items[0], Reasoning)
    done = items[-1]
    assert isinstance(done, Reply) and done.content == "Checking." and done.reasoning == "Look it up."
    assert [(c.id, c.name, c.arguments) for c in done.tool_calls] == [("c1", "get_weather", {"city": "Oslo"})]
    assert done.invalid_tool_calls[0].name == "get_weather" and done.invalid_tool_calls[0].text == "{"
    stats = done.result.stats
    assert (stats.prompt_tokens, stats.cached_tokens, stats.new_tokens, stats.target_forwards) == (50, 30, 20, 10)
    assert stats.fly_forgiven == 1 and stats.seconds == 2.0
    assert done.result.finish_reason == "stop" and done.result.draft_model == "qwen2.5-coder-0.5b-instruct"

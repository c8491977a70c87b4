"""One reply to a conversation with tools (shared by both adapters), on the real default pair."""

import copy

from langchain_core.utils.function_calling import convert_to_openai_tool

from examples.langchain_agent import SYSTEM, calculator
from fly_integrations.replies import ReplyRequest, reply, stream_reply
from fly_runtime import GenerationConfig
from fly_runtime.loader import ModelSettings, get_engine


TOOLS = [convert_to_openai_tool(calculator)]
# a call answered by its result: this model answers it by repeating the call
ANSWERED = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": "What is 1234 * 5678? Use the calculator."},
    {"role": "assistant", "content": "", "tool_calls": [
        {"type": "function", "id": "c1", "function": {"name": "calculator", "arguments": {"expression": "1234 * 5678"}}}]},
    {"role": "tool", "content": "7006652", "tool_call_id": "c1"},
]


def _counting(engine, streams=None):
    """The engine with its requests' prompts (and streams, where a list is given) recorded."""
    prompts = []
    stream = engine.stream

    def recorded(prompt_ids, config):
        prompts.append(list(prompt_ids))
        opened = stream(prompt_ids, config)
        if streams is not None:
            streams.append(opened)
        return opened

    engine.stream = recorded
    return prompts


def _config(stops: tuple[str, ...]) -> GenerationConfig:
    return GenerationConfig(max_new_tokens=64, stop=stops)


def test_a_repeated_call_is_answered_from_the_prompt_already_read_and_counted_whole():
    engine = copy.copy(get_engine(ModelSettings()))
    streams = []
    prompts = _counting(engine, streams)
    items = list(stream_reply(ReplyRequest(engine, ANSWERED, _config, tools=TOOLS)))
    answer = items[-1]
    assert not answer.tool_calls and "7006652" in answer.content.replace(",", "")
    # the model repeated the call, and the retry kept the tools: it read only the steering instruction
    # (the two prompts differ from the role of the turn after the tool result on)
    assert len(prompts) == 2 and prompts[1][: len(prompts[0]) - 2] == prompts[0][:-2]
    assert streams[1].result.stats.cached_tokens == len(prompts[0]) - 2
    # usage counts both generations, and the stream shows exactly the reply's text
    stats = answer.result.stats
    assert stats.prompt_tokens == sum(map(len, prompts))
    assert stats.new_tokens == sum(s.result.stats.new_tokens for s in streams)
    assert "".join(items[:-1]) == answer.content


def test_a_template_that_refuses_the_steering_instruction_answers_without_tools():
    engine = copy.copy(get_engine(ModelSettings()))
    engine.tokenizer = copy.deepcopy(engine.tokenizer)
    # some chat templates accept a system message only first
    engine.tokenizer.chat_template = (
        "{%- for m in messages %}{%- if m.role == 'system' and not loop.first %}"
        "{{ raise_exception('System messages must come first') }}{%- endif %}{%- endfor %}"
        + engine.tokenizer.chat_template)
    prompts = _counting(engine)
    answer = reply(ReplyRequest(engine, ANSWERED, _config, tools=TOOLS))
    assert not answer.tool_calls and "7006652" in answer.content.replace(",", "")
    assert len(prompts) == 2 and "<tools>" not in engine.tokenizer.decode(prompts[1])

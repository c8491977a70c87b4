"""`fly serve` without a model: OpenAI requests translated to fly's, and the engine's queue."""

import asyncio

import pytest

from fly_integrations.server import protocol
from fly_integrations.server.admission import Admission, QueueFull, QueueTimeout
from fly_runtime.errors import InvalidPromptError


def test_openai_messages_become_flys_chat_dicts():
    messages = protocol.chat_messages([
        {"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
        {"role": "tool", "content": "2", "tool_call_id": "c1"},
    ])
    assert messages[0] == {"role": "system", "content": "Be brief."}
    assert messages[1]["tool_calls"][0]["function"] == {"name": "f", "arguments": {"x": 1}}
    assert messages[2] == {"role": "tool", "content": "2", "tool_call_id": "c1"}
    with pytest.raises(InvalidPromptError, match="image_url"):
        protocol.chat_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])
    with pytest.raises(InvalidPromptError, match="not a JSON object"):
        protocol.chat_messages([{"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{"}}]}])


def test_settings_fields_and_formats_translate():
    request = protocol.ChatRequest(messages=[], max_completion_tokens=7, temperature=0.5, mode="exact", k=4,
                                   user="someone")
    assert protocol.overrides(request) == {"max_tokens": 7, "temperature": 0.5, "mode": "exact", "k": 4}
    with pytest.raises(InvalidPromptError, match="unknown request field"):
        protocol.overrides(protocol.ChatRequest(messages=[], warp=9))
    with pytest.raises(InvalidPromptError, match="n must be 1"):
        protocol.overrides(protocol.ChatRequest(messages=[], n=2))
    assert protocol.tool_choice("required") == "any"
    assert protocol.tool_choice({"type": "function", "function": {"name": "f"}}) == "f"
    assert protocol.json_schema({"type": "json_object"}) == {}
    assert protocol.json_schema({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}) \
        == {"type": "object"}
    assert protocol.json_schema({"type": "text"}) is None


def test_the_queue_serves_in_arrival_order_refuses_beyond_its_depth_and_times_out():
    async def scenario() -> tuple[list[int], bool, bool]:
        admission, order = Admission(depth=2), []

        async def request(i: int, hold: float) -> None:
            async with admission.turn(None):
                order.append(i)
                await asyncio.sleep(hold)

        first = asyncio.create_task(request(0, 0.2))
        await asyncio.sleep(0.01)
        waiting = [asyncio.create_task(request(i, 0.01)) for i in (1, 2)]
        await asyncio.sleep(0.01)
        try:
            async with admission.turn(None):
                pass
            refused = False
        except QueueFull as exc:
            refused = exc.retry_after >= 1
        await asyncio.gather(first, *waiting)
        blocker = asyncio.create_task(request(3, 0.3))
        await asyncio.sleep(0.01)
        try:
            async with admission.turn(0.05):
                timed_out = False
        except QueueTimeout:
            timed_out = True
        await blocker
        return order, refused, timed_out

    order, refused, timed_out = asyncio.run(scenario())
    assert order == [0, 1, 2, 3] and refused and timed_out

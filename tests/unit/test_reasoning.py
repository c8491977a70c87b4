"""A thinking model's reasoning read apart from its answer (no model: the splitter, a small real tokenizer with
reasoning tokens, and what each adapter makes of reasoning deltas)."""

import asyncio

import pytest
from langchain_core.language_models.chat_models import generate_from_stream

from fly_integrations import FlyChatModel, FlyLLM
from fly_integrations.reasoning import Reasoning, ReasoningSplitter, answer_text, opens_inside, thinks
from fly_integrations.replies import Reply
from fly_integrations.server import protocol
from fly_runtime.engine import GenerationResult, GenerationStats
from tests.unit.conftest import CHATML, bpe_tokenizer

REPLY = "<think>\nThe user greets me. I greet back.\n</think>\n\nHello! How can I help?"


def split(text: str, size: int, inside: bool = False) -> tuple[str, str]:
    """(reasoning, answer) of ``text`` streamed in pieces of ``size`` characters."""
    splitter = ReasoningSplitter(inside)
    parts = [p for i in range(0, len(text), size) for p in splitter.push(text[i:i + size])] + splitter.finish()
    reasoning = "".join(p for p in parts if isinstance(p, Reasoning))
    assert reasoning == splitter.reasoning
    return reasoning, "".join(answer_text(p) for p in parts)


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_reasoning_that_opens_the_reply_is_split_from_the_answer_however_the_text_arrives(size):
    assert split(REPLY, size) == ("The user greets me. I greet back.\n", "Hello! How can I help?")
    # the chat template opened the block in the prompt (DeepSeek-R1 distills, QwQ): the reply starts inside it
    assert split(REPLY.removeprefix("<think>\n"), size, inside=True) == split(REPLY, size)


@pytest.mark.parametrize("size", [1, 4, 1000])
def test_a_reply_without_a_leading_block_is_all_answer(size):
    text = "Use <think> tags like this: <think>...</think>."
    assert split(text, size) == ("", text)
    assert split("<html>hi</html>", size) == ("", "<html>hi</html>")
    # reasoning cut off by the budget stays reasoning; an empty answer stays empty
    assert split("<think>Let me count: 1, 2, 3", size) == ("Let me count: 1, 2, 3", "")
    assert split("  \n", size) == ("", "  \n")


def test_models_with_reasoning_tokens_are_told_from_others_and_a_block_opened_in_the_prompt_is_seen():
    plain = bpe_tokenizer(["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>"], CHATML)
    thinking = bpe_tokenizer(["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>", "<think>", "</think>"],
                             CHATML.replace("<|im_start|>assistant\n", "<|im_start|>assistant\n<think>\n"))
    assert not thinks(plain) and thinks(thinking)
    messages = [{"role": "user", "content": "Hi"}]
    assert opens_inside(thinking, thinking.apply_chat_template(messages, add_generation_prompt=True))
    assert not opens_inside(plain, plain.apply_chat_template(messages, add_generation_prompt=True))


def a_reply(content: str, reasoning: str) -> Reply:
    stats = GenerationStats(prompt_tokens=5, new_tokens=20, target_forwards=10, seconds=1.0)
    return Reply(content, [], GenerationResult(reasoning + content, [], "stop", stats, None), reasoning=reasoning)


def test_each_adapter_files_reasoning_where_its_users_look_for_it():
    done = a_reply("Hello!", "I greet back.")
    deltas = [Reasoning("I greet "), Reasoning("back."), "Hello!"]
    # LangChain: additional_kwargs["reasoning_content"] (as ChatOllama, ChatDeepSeek), read by content_blocks
    model = FlyChatModel()
    message = generate_from_stream(iter([model._chunk(d, None) for d in [*deltas, done]])).generations[0].message
    assert message.content == "Hello!" and message.additional_kwargs["reasoning_content"] == "I greet back."
    assert message.content_blocks[0] == {"type": "reasoning", "reasoning": "I greet back."}
    # LlamaIndex: thinking deltas while streaming, a ThinkingBlock in the final message
    llm, content = FlyLLM(), ""
    responses = []
    for item in [*deltas, done]:
        content += answer_text(item)
        responses.append(llm._response(item, content))
    assert [r.additional_kwargs.get("thinking_delta") for r in responses[:2]] == ["I greet ", "back."]
    assert [r.delta for r in responses[:3]] == ["", "", "Hello!"]
    final = responses[-1].message
    assert final.content == "Hello!" and final.blocks[0].block_type == "thinking"
    assert final.blocks[0].content == "I greet back."
    # the server: reasoning_content beside content, in whole replies and in stream deltas
    head = protocol.Head.new("chatcmpl", "m", "fly")
    assert protocol.chat_completion(head, done)["choices"][0]["message"] == {
        "role": "assistant", "content": "Hello!", "reasoning_content": "I greet back."}

    async def items():
        for item in [*deltas, done]:
            yield item

    async def chunks():
        return [c async for c in protocol.chat_chunks(head, items())]

    streamed = [c["choices"][0]["delta"] for c in asyncio.run(chunks()) if c["choices"]]
    assert streamed[1:4] == [{"reasoning_content": "I greet "}, {"reasoning_content": "back."}, {"content": "Hello!"}]
    assert "reasoning_content" not in protocol.chat_completion(head, a_reply("Hi", ""))["choices"][0]["message"]

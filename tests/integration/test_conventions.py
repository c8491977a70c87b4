"""Framework conventions on the real pair: LlamaIndex token counting and one callback event per call."""

from llama_index.core.callbacks import CallbackManager, TokenCountingHandler
from llama_index.core.base.llms.types import ChatMessage, MessageRole


from fly_integrations import FlyLLM



def counting_llm() -> tuple[FlyLLM, TokenCountingHandler]:
    handler = TokenCountingHandler(tokenizer=lambda text: [0])  # an estimate that is wrong: usage must win
    return FlyLLM(mode="exact", max_tokens=8, callback_manager=CallbackManager([handler])), handler


def test_token_counting_reads_the_engine_counts():
    llm, handler = counting_llm()
    response = llm.complete("Name a primary colour.")
    usage = response.raw["usage"]
    fly = response.additional_kwargs["fly"]
    assert usage == {"prompt_tokens": fly["prompt_tokens"], "completion_tokens": fly["completion_tokens"],
                     "total_tokens": fly["prompt_tokens"] + fly["completion_tokens"]}
    assert handler.prompt_llm_token_count == usage["prompt_tokens"] > 1
    assert handler.completion_llm_token_count == usage["completion_tokens"] > 1


async def test_achat_fires_one_llm_event():
    llm, handler = counting_llm()
    await llm.achat([ChatMessage(role=MessageRole.USER, content="Name a primary colour.")])
    assert len(handler.llm_token_counts) == 1

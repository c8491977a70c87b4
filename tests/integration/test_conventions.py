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
                     "total_tokens": fly["prompt_tokens"] + fly["completion_tokens"],
                     "prompt_tokens_details": {"cached_tokens": fly["cached_tokens"]}}  # as `fly serve` says it
    assert handler.prompt_llm_token_count == usage["prompt_tokens"] > 1
    assert handler.completion_llm_token_count == usage["completion_tokens"] > 1


async def test_achat_fires_one_llm_event():
    llm, handler = counting_llm()
    await llm.achat([ChatMessage(role=MessageRole.USER, content="Name a primary colour.")])
    assert len(handler.llm_token_counts) == 1


def test_a_target_without_a_drafter_given_gets_the_one_fly_knows(tmp_path):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from fly_runtime import ModelSettings, load_engine
    from fly_runtime.loader import DEFAULT_DRAFT, DEFAULT_TARGET, auto_drafter, load_tokenizer
    from fly_runtime.sources import resolve_model
    from tests.unit.conftest import CHATML
    from tests.unit.test_onnx_build import tiny_tokenizer

    target = resolve_model(DEFAULT_TARGET)
    tokenizer = load_tokenizer(target)
    assert auto_drafter(DEFAULT_TARGET, tokenizer) == DEFAULT_DRAFT  # its built-in pair
    assert auto_drafter(str(target.weights()), tokenizer) == DEFAULT_DRAFT  # a folder of the same family
    # another family: prompt lookup alone, where the default drafter gave a vocabulary error before
    folder = tmp_path / "other-family"
    Qwen2ForCausalLM(Qwen2Config(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(folder)
    tokenizer = tiny_tokenizer()
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(folder)
    engine = load_engine(ModelSettings(target=str(folder), backend="torch", device="cpu"))
    assert engine.draft_name is None and engine.drafter is not None  # prompt lookup
    llm = FlyLLM(target=str(folder), backend="torch", device="cpu", mode="exact", max_tokens=4)
    assert llm.complete("t1 t2 t3").additional_kwargs["fly"]["draft_model"] is None


def test_langchain_counts_tokens_with_the_models_own_tokenizer_and_template_offline():
    """get_num_tokens*, and trim_messages(token_counter=llm), count what a request reads: the default GPT-2
    tokenizer needs the Hub, which is not there."""
    from langchain_core.messages import AIMessage, HumanMessage, SystemMessage, trim_messages
    from langchain_core.tools import tool

    from fly_integrations import FlyChatModel

    @tool
    def lookup(city: str) -> str:
        """The population of a city."""
        return "1"

    llm = FlyChatModel(max_tokens=1)
    assert llm.get_num_tokens("Hello world") == len(llm.tokenizer().encode("Hello world", add_special_tokens=False))
    chat = [SystemMessage("Be brief."), HumanMessage("What is 2 + 2?"), AIMessage("4"), HumanMessage("And 3 + 3?")]
    assert llm.get_num_tokens_from_messages(chat) == llm.invoke(chat).usage_metadata["input_tokens"]
    with_tools = llm.get_num_tokens_from_messages(chat, tools=[lookup])
    assert with_tools == llm.bind_tools([lookup]).invoke(chat).usage_metadata["input_tokens"]
    assert with_tools > llm.get_num_tokens_from_messages(chat)
    long_chat = [SystemMessage("Be brief.")] + [HumanMessage(f"Question {i} about caching?") for i in range(30)]
    kept = trim_messages(long_chat, max_tokens=120, token_counter=llm, strategy="last", include_system=True)
    assert kept[0] == long_chat[0] and 1 < len(kept) < len(long_chat)
    assert llm.get_num_tokens_from_messages(kept) <= 120


def test_the_profile_tells_agent_frameworks_what_the_model_does():
    from langchain.agents.factory import _supports_provider_strategy

    from fly_integrations import FlyChatModel

    llm = FlyChatModel(context_window=4096)
    assert llm.profile["tool_calling"] and llm.profile["max_input_tokens"] == 4096
    # a reply is either a tool call or JSON under the grammar, not both: create_agent's tool strategy serves it
    assert not _supports_provider_strategy(llm, tools=[])

"""The adapters' constructor follows the frameworks' conventions (no model loads here)."""

import pytest
from pydantic import ValidationError

from fly_integrations import FlyChatModel, FlyLLM


@pytest.mark.parametrize("cls, name", [(FlyChatModel, "model"), (FlyLLM, "model"), (FlyLLM, "model_name"),
                                       (FlyChatModel, "target")])
def test_model_names_the_target(cls, name):
    assert cls(**{name: "Qwen/Qwen2.5-7B-Instruct"}).target == "Qwen/Qwen2.5-7B-Instruct"


@pytest.mark.parametrize("cls", [FlyChatModel, FlyLLM])
def test_draft_model_names_the_drafter(cls):
    assert cls(draft_model="my-drafter").draft == "my-drafter"
    assert cls(draft=None).draft is None


@pytest.mark.parametrize("cls", [FlyChatModel, FlyLLM])
def test_an_unknown_keyword_is_an_error_that_names_it(cls):
    with pytest.raises(ValidationError, match="modle"):
        cls(modle="Qwen/Qwen2.5-7B-Instruct")


@pytest.mark.parametrize("cls", [FlyChatModel, FlyLLM])
def test_ollama_and_llama_cpp_names_set_the_same_settings(cls):
    llm = cls(num_predict=64, repeat_penalty=1.1, num_ctx=2048, min_p=0.05, frequency_penalty=0.2)
    assert (llm.max_tokens, llm.repetition_penalty, llm.context_window) == (64, 1.1, 2048)
    config = llm.generation_config()
    assert (config.max_new_tokens, config.repetition_penalty, config.min_p, config.frequency_penalty) == \
        (64, 1.1, 0.05, 0.2)


def test_a_misspelt_call_keyword_is_an_error_not_dropped(monkeypatch):
    """Per call too (ChatOpenAI's server answers 400): checked before any model loads."""
    from fly_runtime import InvalidSettingsError

    llm = FlyChatModel()
    monkeypatch.setattr(FlyChatModel, "engine", lambda self, target=None: pytest.fail("loaded a model"))
    with pytest.raises(InvalidSettingsError, match="temprature"):
        _request(llm, {"temprature": 0.5})
    with pytest.raises(InvalidSettingsError, match="repetition_penalty"):
        _request(llm, {"repeat_penalty": 0})  # an Ollama name, checked as the setting it is
    remote = FlyChatModel(base_url="http://127.0.0.1:9/v1")  # and before anything is sent to a server
    with pytest.raises(InvalidSettingsError, match="repetition_penalty"):
        remote._transport._body(remote, remote._call([], None, {"repeat_penalty": 0}))


def _request(llm, kwargs):
    """The request the local transport makes of a LangChain call with ``kwargs``."""
    from fly_integrations.transport import Local

    return Local._request(llm, llm._call([], None, kwargs))


def test_ollama_format_asks_for_json_as_response_format_does(monkeypatch):
    from fly_integrations.messages import format_schema

    assert format_schema("json") == {} and format_schema({"type": "object"}) == {"type": "object"}
    assert format_schema(None) is None
    monkeypatch.setattr(FlyChatModel, "engine", lambda self, target=None: None)
    llm = FlyChatModel(format="json")
    assert _request(llm, {}).json_schema == {}
    assert _request(llm, {"format": {"type": "array"}}).json_schema == {"type": "array"}
    schema = {"type": "json_schema", "json_schema": {"schema": {"type": "string"}}}
    assert _request(llm, {"response_format": schema}).json_schema == {"type": "string"}

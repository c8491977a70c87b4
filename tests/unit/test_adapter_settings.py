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

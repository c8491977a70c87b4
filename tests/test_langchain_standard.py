"""LangChain's standard test suites for FlyChatModel: unit (no model loads) and integration (real pair)."""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests
from langchain_tests.unit_tests import ChatModelUnitTests

from fly_integrations import FlyChatModel


class _FlyChatModelConfig:
    @property
    def chat_model_class(self) -> type[FlyChatModel]:
        return FlyChatModel

    @property
    def chat_model_params(self) -> dict:
        return {}  # the suite's standard params already cap replies at 100 tokens

    @property
    def has_tool_choice(self) -> bool:
        return True

    @property
    def supports_json_mode(self) -> bool:
        return True

    @property
    def supports_model_override(self) -> bool:
        # `model=` per call works (it names another target), but the suite's override test would load a
        # second 1.5B-class model in CI for no extra coverage of FLy itself
        return False


class TestFlyChatModelUnit(_FlyChatModelConfig, ChatModelUnitTests):
    pass


@pytest.mark.real_model
class TestFlyChatModelIntegration(_FlyChatModelConfig, ChatModelIntegrationTests):
    pass

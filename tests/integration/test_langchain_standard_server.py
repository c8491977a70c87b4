"""LangChain's standard integration suite for FlyChatModel(base_url=...), talking to `fly serve`."""

import pytest
from langchain_tests.integration_tests import ChatModelIntegrationTests

from tests.integration.conftest import KEY
from tests.langchain_standard import FlyChatModelConfig


class TestFlyChatModelOverServer(FlyChatModelConfig, ChatModelIntegrationTests):
    url: str | None = None

    @pytest.fixture(autouse=True)
    def _served(self, fly_server):
        type(self).url = fly_server["url"]

    @property
    def chat_model_params(self) -> dict:
        return {"base_url": self.url, "api_key": KEY}

"""LangChain's standard integration suite for FlyChatModel, on the real pair."""

from langchain_tests.integration_tests import ChatModelIntegrationTests

from tests.langchain_standard import FlyChatModelConfig


class TestFlyChatModelIntegration(FlyChatModelConfig, ChatModelIntegrationTests):
    pass

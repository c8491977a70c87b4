"""LangChain's standard unit suite for FlyChatModel: construction, settings, serialisation (no model loads)."""

from langchain_tests.unit_tests import ChatModelUnitTests

from tests.langchain_standard import FlyChatModelConfig


class TestFlyChatModelUnit(FlyChatModelConfig, ChatModelUnitTests):
    pass

"""The settings LangChain's standard test suites read for FlyChatModel (shared by the unit and integration runs)."""

from fly_integrations import FlyChatModel


class FlyChatModelConfig:
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

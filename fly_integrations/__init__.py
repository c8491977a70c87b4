"""fly_integrations: FLy as a drop-in model for LangChain (FlyChatModel) and LlamaIndex (FlyLLM).

Each adapter imports its framework only when it is used, so installing one framework is enough.
"""

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from fly_integrations.langchain import FlyChatModel
    from fly_integrations.llama_index import FlyLLM

__all__ = ["FlyChatModel", "FlyLLM"]


def __getattr__(name: str) -> Any:
    if name == "FlyChatModel":
        from fly_integrations.langchain import FlyChatModel

        return FlyChatModel
    if name == "FlyLLM":
        from fly_integrations.llama_index import FlyLLM

        return FlyLLM
    raise AttributeError(name)

"""LlamaIndex LLM on the FLy runtime: messages in, engine call, ChatResponse / CompletionResponse out."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from llama_index.core.base.llms.types import (
    ChatMessage,
    ChatResponse,
    ChatResponseAsyncGen,
    ChatResponseGen,
    CompletionResponse,
    CompletionResponseAsyncGen,
    CompletionResponseGen,
    LLMMetadata,
    MessageRole,
    TextBlock,
    ThinkingBlock,
    ToolCallBlock,
)
from llama_index.core.base.llms.generic_utils import (
    achat_to_completion_decorator,
    astream_chat_to_completion_decorator,
    chat_to_completion_decorator,
    stream_chat_to_completion_decorator,
)
from llama_index.core.llms.callbacks import llm_chat_callback, llm_completion_callback
from llama_index.core.llms.function_calling import FunctionCallingLLM
from llama_index.core.llms.llm import ToolSelection
from llama_index.core.tools import BaseTool
from pydantic import ConfigDict, Field, PrivateAttr

from fly_integrations.messages import ROLE_NAMES, chat_message, usage
from fly_integrations.params import FlyParams
from fly_integrations.reasoning import Reasoning, answer_text
from fly_integrations.replies import Reply
from fly_integrations.transport import Call, transport
from fly_integrations.tool_calls import tool_format
from fly_integrations.tools import validate_tool_schema
from fly_runtime.errors import InvalidPromptError


class FlyLLM(FlyParams, FunctionCallingLLM):
    """A local LLM decoded with FLy speculative decoding, for query engines, chat engines and agents: a
    LlamaIndex ``FunctionCallingLLM``.

    Setup: ``pip install fly-integrations`` and ``fly models fetch`` (the default pair, once). Shares loaded
    weights with every ``FlyChatModel`` / ``FlyLLM`` that has the same model settings.

    Use it where LlamaIndex takes an LLM::

        from llama_index.core import Settings
        from fly_integrations import FlyLLM
        Settings.llm = FlyLLM(max_tokens=256)
        index.as_query_engine().query("What does the report say about costs?")

    Complete, chat, stream and async::

        FlyLLM().complete("Name three primary colours.").text
        for r in FlyLLM().stream_chat([ChatMessage(role="user", content="Hi")]): print(r.delta, end="")
        await FlyLLM().acomplete("Hello")        # concurrent calls decode together on a llama.cpp target

    Tools and structured output: ``predict_and_call`` / ``FunctionAgent`` with ``FunctionTool`` s, and
    ``structured_predict(Model, prompt)`` (decoded under the schema's grammar). A server instead of local
    weights: ``FlyLLM(base_url="http://127.0.0.1:8000/v1")`` (``fly serve``).
    """

    model_config = ConfigDict(extra="forbid")  # an unknown keyword is an error, not silently dropped

    base_url: str | None = Field(
        default=None, description="a `fly serve` (or other OpenAI-compatible) endpoint, e.g. http://127.0.0.1:8000/v1: "
                                  "talk to it instead of loading the models in this process")
    api_key: str | None = Field(default=None, description="the server's key (base_url)")

    _metadata: LLMMetadata | None = PrivateAttr(default=None)
    _transport: Any = PrivateAttr(default=None)  # this process's engine, or the server at base_url

    @classmethod
    def class_name(cls) -> str:
        return "FlyLLM"

    @property
    def metadata(self) -> LLMMetadata:
        if self._metadata is None and self._transport.remote:  # the server's model: its window is the setting
            self._metadata = LLMMetadata(context_window=self.context_window or 8192, num_output=self.max_tokens,
                                         is_chat_model=True, is_function_calling_model=True, model_name=self.target)
        if self._metadata is None:
            # the setting, at most the target's window (which needs its config: loaded once, on first ask)
            engine = self.engine()
            window = engine.max_context
            self._metadata = LLMMetadata(
                context_window=min(window, self.context_window or window),
                num_output=self.max_tokens,
                is_chat_model=True,
                is_function_calling_model=tool_format(engine.tokenizer) is not None,  # its template renders tools
                model_name=self.target,
            )
        return self._metadata

    # ------------------------------------------------------------------------------------------ requests
    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        self._transport = transport(self.base_url, self.api_key, 0, self.timeout)

    def _call(self, messages: Sequence[ChatMessage], kwargs: dict[str, Any]) -> Call:
        tools = kwargs.get("tools")
        return Call([_to_chat_dict(m, i) for i, m in enumerate(messages)], kwargs.get("stop"), kwargs, tools=tools,
                    tool_choice="any" if kwargs.get("tool_required") and tools else None)

    def _response(self, item: str | Reply, content: str) -> ChatResponse:
        """A streamed delta, or (for a Reply) the closing response with tool calls and FLy stats. Reasoning
        streams as ``thinking_delta`` (as LlamaIndex's Ollama integration streams it) and ends in a ThinkingBlock."""
        if isinstance(item, Reasoning):
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content), delta="",
                                additional_kwargs={"thinking_delta": str(item)})
        if isinstance(item, str):
            return ChatResponse(message=ChatMessage(role=MessageRole.ASSISTANT, content=content), delta=item)
        extra: dict[str, Any] = {}
        if item.tool_calls:
            extra["tool_calls"] = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in item.tool_calls]
        if item.invalid_tool_calls:
            extra["invalid_tool_calls"] = [{"id": c.id, "name": c.name, "text": c.text, "error": c.error}
                                           for c in item.invalid_tool_calls]
        counts = usage(item.result.stats)
        fly = {**self.fly_metadata(item.result), "prompt_tokens": counts["prompt_tokens"],
               "completion_tokens": counts["completion_tokens"]}
        blocks = [ThinkingBlock(content=item.reasoning)] if item.reasoning else []
        return ChatResponse(
            message=ChatMessage(role=MessageRole.ASSISTANT, additional_kwargs=extra,
                                blocks=[*blocks, TextBlock(text=item.content)]),
            delta="",
            raw={"fly": fly, "usage": counts},  # LlamaIndex's TokenCountingHandler reads "usage"
            additional_kwargs={"fly": fly},
        )

    # Each public method is decorated once and calls an undecorated implementation, so one call is one callback
    # event: completion through a decorated chat would count its tokens twice in TokenCountingHandler.
    @llm_chat_callback()
    def chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return self._chat(messages, **kwargs)

    def _chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = None
        for response in self._stream_chat(messages, **kwargs):
            pass
        assert response is not None
        return response

    @llm_chat_callback()
    def stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        return self._stream_chat(messages, **kwargs)

    def _stream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseGen:
        items = self._transport.stream(self, self._call(messages, kwargs))  # checked now, not at the first next()

        def gen() -> ChatResponseGen:
            content = ""
            try:
                for item in items:
                    content += answer_text(item)
                    yield self._response(item, content)
            finally:
                items.close()  # an abandoned stream ends the generation and frees the engine (or the connection)

        return gen()

    @llm_chat_callback()
    async def achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        return await self._achat(messages, **kwargs)

    async def _achat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponse:
        response = None
        async for response in await self._astream_chat(messages, **kwargs):
            pass
        assert response is not None
        return response

    @llm_chat_callback()
    async def astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        return await self._astream_chat(messages, **kwargs)

    async def _astream_chat(self, messages: Sequence[ChatMessage], **kwargs: Any) -> ChatResponseAsyncGen:
        items = self._transport.astream(self, self._call(messages, kwargs))

        async def gen() -> ChatResponseAsyncGen:
            content = ""
            async for item in items:
                content += answer_text(item)
                yield self._response(item, content)

        return gen()

    # ------------------------------------------------------------------------------------------ completion
    # completion is chat on one user message, through LlamaIndex's own chat-to-completion converters
    def _as_chat(self, chat: Callable[..., Any], prompt: str, formatted: bool) -> Callable[..., Any]:
        """``chat`` as the converters call it, with the system prompt first unless the prompt is formatted."""
        if not prompt.strip():
            raise InvalidPromptError("the prompt is empty: pass some text")

        def with_system(messages: list[ChatMessage], **kwargs: Any) -> Any:
            if self.system_prompt and not formatted:
                messages = [ChatMessage(role=MessageRole.SYSTEM, content=self.system_prompt), *messages]
            return chat(messages, **kwargs)

        return with_system

    @llm_completion_callback()
    def complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return chat_to_completion_decorator(self._as_chat(self._chat, prompt, formatted))(prompt, **kwargs)

    @llm_completion_callback()
    def stream_complete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponseGen:
        chat = self._as_chat(self._stream_chat, prompt, formatted)
        return stream_chat_to_completion_decorator(chat)(prompt, **kwargs)

    @llm_completion_callback()
    async def acomplete(self, prompt: str, formatted: bool = False, **kwargs: Any) -> CompletionResponse:
        return await achat_to_completion_decorator(self._as_chat(self._achat, prompt, formatted))(prompt, **kwargs)

    @llm_completion_callback()
    async def astream_complete(
        self, prompt: str, formatted: bool = False, **kwargs: Any
    ) -> CompletionResponseAsyncGen:
        chat = self._as_chat(self._astream_chat, prompt, formatted)
        return await astream_chat_to_completion_decorator(chat)(prompt, **kwargs)

    # ----------------------------------------------------------------------------------------------- tools
    def _prepare_chat_with_tools(
        self,
        tools: Sequence[BaseTool],
        user_msg: str | ChatMessage | None = None,
        chat_history: list[ChatMessage] | None = None,
        verbose: bool = False,
        allow_parallel_tool_calls: bool = False,
        tool_required: bool = False,
        **kwargs: Any,
    ) -> dict[str, Any]:
        specs = [validate_tool_schema(t.metadata.to_openai_tool()) for t in tools]
        messages = list(chat_history or [])
        if user_msg is not None:
            messages.append(ChatMessage(role=MessageRole.USER, content=user_msg) if isinstance(user_msg, str)
                            else user_msg)
        return {"messages": messages, "tools": specs or None, "tool_required": tool_required, **kwargs}

    def _validate_chat_with_tools_response(
        self,
        response: ChatResponse,
        tools: Sequence[BaseTool],
        allow_parallel_tool_calls: bool = False,
        **kwargs: Any,
    ) -> ChatResponse:
        if not allow_parallel_tool_calls:
            calls = response.message.additional_kwargs.get("tool_calls", [])
            if len(calls) > 1:
                response.message.additional_kwargs["tool_calls"] = calls[:1]
        return response

    def get_tool_calls_from_response(
        self, response: ChatResponse, error_on_no_tool_call: bool = True, **kwargs: Any
    ) -> list[ToolSelection]:
        calls = response.message.additional_kwargs.get("tool_calls", [])
        invalid = response.message.additional_kwargs.get("invalid_tool_calls", [])
        if not calls and error_on_no_tool_call:
            if invalid:
                raise ValueError(f"the model wrote a tool call that does not parse ({invalid[0]['error']}): "
                                 f"{invalid[0]['text']!r}")
            raise ValueError(f"expected at least one tool call, got none; the model said: {response.message.content!r}")
        return [ToolSelection(tool_id=c["id"], tool_name=c["name"], tool_kwargs=c["arguments"]) for c in calls]


def _text_of(message: ChatMessage, index: int) -> str:
    parts = []
    for block in message.blocks:
        if isinstance(block, TextBlock):
            parts.append(block.text)
        elif isinstance(block, (ThinkingBlock, ToolCallBlock)):
            continue  # reasoning is not read again (as thinking models' templates drop it); calls: _to_chat_dict
        else:
            raise InvalidPromptError(
                f"message {index} has a {type(block).__name__}; this model reads text only (pass TextBlocks)"
            )
    return "".join(parts)


def _to_chat_dict(message: ChatMessage, index: int) -> dict[str, Any]:
    role = message.role.value if isinstance(message.role, MessageRole) else str(message.role)
    extra = message.additional_kwargs
    calls = extra.get("tool_calls") or [{"id": b.tool_call_id, "name": b.tool_name, "arguments": b.tool_kwargs}
                                        for b in message.blocks if isinstance(b, ToolCallBlock)]
    return chat_message(role, _text_of(message, index), tool_calls=calls or None,
                        tool_call_id=extra.get("tool_call_id") if ROLE_NAMES.get(role, role) == "tool" else None)

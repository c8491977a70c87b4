"""LangChain chat model on the FLy runtime: messages in, engine call, AIMessage / chunks out."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from operator import itemgetter
from typing import Any, Literal

import jsonschema

from langchain_core.callbacks import AsyncCallbackManagerForLLMRun, CallbackManagerForLLMRun
from langchain_core.language_models import BaseChatModel, LanguageModelInput
from langchain_core.language_models.chat_models import LangSmithParams, agenerate_from_stream, generate_from_stream
from langchain_core.messages import (
    AIMessage,
    AIMessageChunk,
    BaseMessage,
    ChatMessage,
    HumanMessage,
    SystemMessage,
    ToolMessage,
)
from langchain_core.messages.ai import UsageMetadata
from langchain_core.messages.tool import tool_call_chunk
from langchain_core.exceptions import OutputParserException
from langchain_core.output_parsers import JsonOutputKeyToolsParser, JsonOutputParser, PydanticOutputParser
from langchain_core.output_parsers.openai_tools import PydanticToolsParser
from langchain_core.outputs import ChatGenerationChunk, ChatResult
from langchain_core.runnables import Runnable, RunnableConfig, RunnableLambda, RunnableMap, RunnablePassthrough
from langchain_core.runnables.config import get_config_list
from langchain_core.tools import BaseTool
from langchain_core.utils.function_calling import convert_to_json_schema, convert_to_openai_tool
from langchain_core.utils.pydantic import is_basemodel_subclass
from pydantic import ConfigDict, Field, PrivateAttr, SecretStr, model_validator

from fly_integrations.messages import chat_message, response_schema, usage
from fly_integrations.params import CALL_ALIASES, OVERRIDABLE, FlyParams
from fly_integrations.prompting import TemplateRefused, render_prompt
from fly_integrations.reasoning import Reasoning
from fly_integrations.replies import Reply
from fly_integrations.transport import Call, transport
from fly_integrations.tools import normalize_tool_choice, validate_tool_schema
from fly_runtime import GenerationResult
from fly_runtime.errors import InvalidPromptError, InvalidSettingsError


# per-call keywords besides the settings: what bind_tools, structured output and agent frameworks pass (strict and
# parallel_tool_calls are OpenAI's: every call is checked against its schema, several calls may come at once),
# Ollama's format, llama-server's cache_prompt (a cached prefix is always reused)
_CALL_FIELDS = {"tools", "tool_choice", "response_format", "model", "strict", "parallel_tool_calls",
                "ls_structured_output_format", "format", "cache_prompt"}


class FlyChatModel(FlyParams, BaseChatModel):
    """A local chat model decoded with FLy speculative decoding: a drop-in LangChain ``BaseChatModel``.

    Setup: ``pip install fly-integrations`` and ``fly models fetch`` (the default pair, once). Weights load on
    first use and are shared by every instance (and every ``FlyLLM``) with the same model settings.

    Instantiate::

        from fly_integrations import FlyChatModel
        llm = FlyChatModel(max_tokens=256, temperature=0)   # settings: see the README's table

    Invoke, stream, batch and async::

        llm.invoke("Name three primary colours.").content
        for chunk in llm.stream("Write a haiku about rain."): print(chunk.content, end="")
        llm.batch(["2 + 2?", "3 + 3?"])                      # decoded together on a llama.cpp target
        await llm.ainvoke("Hello")                           # never blocks the event loop

    Tool calling (``tool_choice`` is honoured: "auto", "any", "none" or a tool's name)::

        llm.bind_tools([get_weather]).invoke("Weather in Oslo?").tool_calls

    Structured output (decoded under the schema's grammar)::

        llm.with_structured_output(Person).invoke("Alice is 31.")   # -> Person(name="Alice", age=31)

    A server instead of local weights: ``FlyChatModel(base_url="http://127.0.0.1:8000/v1")`` (``fly serve``).
    Every reply's ``response_metadata`` holds its decoding statistics (``mean_accepted``: tokens a target pass,
    ``cached_tokens``, ``tokens_per_second``, ...) beside the finish reason and the models that served it.
    """

    # an unknown keyword is an error, not silently dropped (FlyChatModel(modle=...) would load the default pair)
    model_config = ConfigDict(populate_by_name=True, protected_namespaces=(), extra="forbid")

    stop: list[str] | None = Field(default=None, alias="stop_sequences")
    streaming: bool = False
    max_retries: int = Field(
        default=0, description="retries of a call to a server (base_url); local calls are not retried")
    api_key: SecretStr | None = Field(
        default=None, description="the server's key (base_url); a local model needs none")
    base_url: str | None = Field(
        default=None, description="a `fly serve` (or other OpenAI-compatible) endpoint, e.g. http://127.0.0.1:8000/v1: "
                                  "talk to it instead of loading the models in this process")
    _transport: Any = PrivateAttr(default=None)  # this process's engine, or the server at base_url

    @property
    def _llm_type(self) -> str:
        return "fly"

    @property
    def _identifying_params(self) -> dict[str, Any]:
        # the models, and every setting a call may override (which is every setting that shapes the output)
        return {name: getattr(self, name) for name in ("target", "draft", "backend", "precision", *OVERRIDABLE)}

    def _get_ls_params(self, stop: list[str] | None = None, **kwargs: Any) -> LangSmithParams:
        params = LangSmithParams(
            ls_provider="fly",
            ls_model_name=kwargs.get("model", self.target),
            ls_model_type="chat",
            ls_temperature=kwargs.get("temperature", self.temperature),
            ls_max_tokens=kwargs.get("max_tokens", self.max_tokens),
        )
        if stop or self.stop:
            params["ls_stop"] = list(stop or self.stop or [])
        return params

    def batch(self, inputs: list[LanguageModelInput], config: RunnableConfig | list[RunnableConfig] | None = None,
              *, return_exceptions: bool = False, **kwargs: Any) -> list[AIMessage]:
        """Every input at once unless ``max_concurrency`` says otherwise: the engine decodes the requests
        together (up to ``max_batch``, the rest queue), where LangChain's default pool would run only
        min(32, CPUs + 4) of them at a time (docs/design.md, "Concurrency")."""
        configs = [c if c.get("max_concurrency") is not None else {**c, "max_concurrency": max(1, len(inputs))}
                   for c in get_config_list(config, len(inputs))]
        return super().batch(inputs, configs, return_exceptions=return_exceptions, **kwargs)

    # --------------------------------------------------------------------------------------------- tokens
    def get_token_ids(self, text: str) -> list[int]:
        """``text``'s ids under the target's own tokenizer (LangChain's default counts with GPT-2's, from the Hub)."""
        return self.tokenizer().encode(text, add_special_tokens=False)

    def get_num_tokens_from_messages(self, messages: list[BaseMessage],
                                     tools: Sequence[dict[str, Any] | type | Callable | BaseTool] | None = None) -> int:
        """Tokens of the prompt these messages (and tools) make, rendered by the target's chat template as a request
        renders them, the assistant's opening included: what counts against ``context_window``. A list the
        template refuses on its own (``trim_messages`` tries partial lists) counts each message as rendered
        alone."""
        if not messages:
            return 0
        formatted = [convert_to_openai_tool(t) for t in tools] if tools else None
        dicts = [_to_chat_dict(m, i) for i, m in enumerate(messages)]
        tokenizer = self.tokenizer()
        try:
            return len(render_prompt(tokenizer, dicts, formatted).token_ids)
        except TemplateRefused:
            return sum(len(render_prompt(tokenizer, [m]).token_ids) for m in dicts)

    @model_validator(mode="after")
    def _default_profile(self) -> "FlyChatModel":
        """What agent frameworks read to pick a strategy (create_agent's structured output, say): tool calling
        and the window; structured output is decoded under a grammar, but not beside tools in one reply, so
        create_agent's tool strategy serves it where tools are bound."""
        if self.profile is None:
            self.profile = {"max_input_tokens": self.context_window, "max_output_tokens": self.max_tokens,
                            "text_inputs": True, "text_outputs": True, "image_inputs": False,
                            "tool_calling": True, "tool_choice": True, "structured_output": False,
                            "open_weights": True}
        return self

    # ------------------------------------------------------------------------------------------ requests
    def model_post_init(self, context: Any) -> None:
        super().model_post_init(context)
        key = self.api_key.get_secret_value() if self.api_key is not None else None
        self._transport = transport(self.base_url, key, self.max_retries, self.timeout)

    def _call(self, messages: list[BaseMessage], stop: list[str] | None, kwargs: dict[str, Any]) -> Call:
        unknown = sorted(set(kwargs) - set(OVERRIDABLE) - set(CALL_ALIASES) - _CALL_FIELDS)
        if unknown:  # as ChatOpenAI's server would answer 400: a misspelt setting must not be dropped silently
            raise InvalidSettingsError(f"unknown call keyword(s) {unknown}: FlyChatModel takes {sorted(OVERRIDABLE)}, "
                                       f"their Ollama names {sorted(CALL_ALIASES)} and {sorted(_CALL_FIELDS)}")
        return Call([_to_chat_dict(m, i) for i, m in enumerate(messages)], stop, kwargs, model=kwargs.get("model"),
                    tools=kwargs.get("tools"), tool_choice=kwargs.get("tool_choice"),
                    json_schema=response_schema(kwargs.get("response_format")))

    def _response_metadata(self, result: GenerationResult, model: str | None) -> dict[str, Any]:
        return self.fly_metadata(result, model)

    # one path for every reply, as ChatOllama: the message is the stream's chunks merged (text, tool calls,
    # usage and stats ride on its last chunk), whether the engine runs here or on a server
    def _generate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return generate_from_stream(self._stream(messages, stop, run_manager, **kwargs))

    def _stream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: CallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> Iterator[ChatGenerationChunk]:
        items = self._transport.stream(self, self._call(messages, stop, kwargs))
        try:
            for item in items:
                chunk = self._chunk(item, kwargs.get("model"))
                if run_manager and chunk.text:
                    run_manager.on_llm_new_token(chunk.text, chunk=chunk)
                yield chunk
        finally:
            items.close()  # an abandoned stream ends the generation and frees the engine (or the connection)

    async def _agenerate(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> ChatResult:
        return await agenerate_from_stream(self._astream(messages, stop, run_manager, **kwargs))

    async def _astream(
        self,
        messages: list[BaseMessage],
        stop: list[str] | None = None,
        run_manager: AsyncCallbackManagerForLLMRun | None = None,
        **kwargs: Any,
    ) -> AsyncIterator[ChatGenerationChunk]:
        async for item in self._transport.astream(self, self._call(messages, stop, kwargs)):
            chunk = self._chunk(item, kwargs.get("model"))
            if run_manager and chunk.text:
                await run_manager.on_llm_new_token(chunk.text, chunk=chunk)
            yield chunk

    def _chunk(self, item: str | Reply, model: str | None) -> ChatGenerationChunk:
        """A text delta, or the closing chunk with the tool calls, usage and FLy stats. Reasoning goes where
        ChatOllama and ChatDeepSeek put it (``additional_kwargs["reasoning_content"]``, read by ``content_blocks``)."""
        if isinstance(item, Reasoning):
            return ChatGenerationChunk(message=AIMessageChunk(content="", additional_kwargs={"reasoning_content": item}))
        if isinstance(item, str):
            return ChatGenerationChunk(message=AIMessageChunk(content=item))
        chunks = [tool_call_chunk(name=c.name, args=json.dumps(c.arguments, ensure_ascii=False), id=c.id, index=i)
                  for i, c in enumerate(item.tool_calls)]
        # a call that did not parse keeps its text as args, which LangChain's chunk merge files as invalid
        chunks += [tool_call_chunk(name=c.name, args=c.text, id=c.id, index=len(chunks) + i)
                   for i, c in enumerate(item.invalid_tool_calls)]
        # usage and stats ride on the last chunk only, so aggregating the stream counts them once
        return ChatGenerationChunk(message=AIMessageChunk(
            content="",
            tool_call_chunks=chunks,
            usage_metadata=_usage(item.result),
            response_metadata=self._response_metadata(item.result, model),
            chunk_position="last",
        ))

    # ------------------------------------------------------------------------------------ tools & output
    def bind_tools(
        self,
        tools: Sequence[dict[str, Any] | type | Callable | BaseTool],
        *,
        tool_choice: str | bool | dict | None = None,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, AIMessage]:
        formatted = [validate_tool_schema(convert_to_openai_tool(t)) for t in tools]
        choice = normalize_tool_choice(tool_choice, [t["function"]["name"] for t in formatted])
        return super().bind(tools=formatted, tool_choice=choice, **kwargs)

    def with_structured_output(
        self,
        schema: dict | type,
        *,
        method: Literal["function_calling", "json_schema", "json_mode"] = "json_schema",
        include_raw: bool = False,
        **kwargs: Any,
    ) -> Runnable[LanguageModelInput, dict | Any]:
        # json_schema / json_mode replies are decoded under the schema's grammar whatever `strict` says; function
        # calls are verified exactly and, as every method's result, validated against the schema
        kwargs.pop("strict", None)
        if kwargs:
            raise ValueError(f"unsupported arguments for with_structured_output: {sorted(kwargs)}")
        is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
        trace = {"ls_structured_output_format": {"kwargs": {"method": method}, "schema": schema}}
        if method == "function_calling":
            name = convert_to_openai_tool(schema)["function"]["name"]
            llm = self.bind_tools([schema], tool_choice=name, **trace)
            parser: Runnable = (PydanticToolsParser(tools=[schema], first_tool_only=True) if is_pydantic
                                else JsonOutputKeyToolsParser(key_name=name, first_tool_only=True)
                                | _validator(convert_to_openai_tool(schema)["function"].get("parameters", {})))
        elif method in ("json_schema", "json_mode"):
            if method == "json_schema":
                json_schema = convert_to_json_schema(schema)  # OpenAI's format names the schema (a server requires it)
                fmt = {"type": "json_schema", "json_schema": {"name": json_schema.get("title") or "answer",
                                                              "schema": json_schema}}
            else:
                fmt = {"type": "json_object"}
            llm = self.bind(response_format=fmt, **trace)
            parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
            if method == "json_schema" and not is_pydantic:
                parser = parser | _validator(convert_to_json_schema(schema))
        else:
            raise ValueError(f"method must be function_calling, json_schema or json_mode, got {method!r}")
        if not include_raw:
            return llm | parser
        with_parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
        without = RunnablePassthrough.assign(parsed=lambda _: None)
        return RunnableMap(raw=llm) | with_parsed.with_fallbacks([without], exception_key="parsing_error")


def _validator(schema: dict) -> Runnable:
    """A step that passes a parsed value on if it follows ``schema`` and raises OutputParserException if not."""

    def validate(value: Any) -> Any:
        try:
            jsonschema.validate(value, schema)
        except jsonschema.ValidationError as exc:
            raise OutputParserException(f"the reply does not follow the schema: {exc.message}",
                                        llm_output=json.dumps(value, ensure_ascii=False)) from None
        return value

    return RunnableLambda(validate)


def _usage(result: GenerationResult) -> UsageMetadata:
    """The reply's usage under LangChain's names."""
    counts = usage(result.stats)
    return {"input_tokens": counts["prompt_tokens"], "output_tokens": counts["completion_tokens"],
            "total_tokens": counts["total_tokens"],
            "input_token_details": {"cache_read": counts["prompt_tokens_details"]["cached_tokens"]}}


def _text_of(content: str | list, index: int) -> str:
    if isinstance(content, str):
        return content
    parts = []
    for block in content:
        if isinstance(block, str):
            parts.append(block)
        elif isinstance(block, dict) and block.get("type") == "text":
            parts.append(block.get("text", ""))
        elif isinstance(block, dict) and block.get("type") in ("tool_use", "tool_call"):
            continue  # carried by AIMessage.tool_calls
        else:
            kind = block.get("type") if isinstance(block, dict) else type(block).__name__
            raise InvalidPromptError(
                f"message {index} has a {kind!r} content block; this model reads text only "
                "(pass text blocks or a string)"
            )
    return "".join(parts)


def _to_chat_dict(message: BaseMessage, index: int = 0) -> dict[str, Any]:
    content = _text_of(message.content, index)
    if isinstance(message, ToolMessage):
        if getattr(message, "status", "success") == "error":
            content = f"Error: {content}"
        return chat_message("tool", content, tool_call_id=message.tool_call_id)
    if isinstance(message, AIMessage):
        calls = [{"id": c.get("id"), "name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
        return chat_message("assistant", content, tool_calls=calls)
    if isinstance(message, SystemMessage):
        return chat_message("system", content)
    if isinstance(message, HumanMessage):
        return chat_message("user", content)
    if isinstance(message, ChatMessage):
        return chat_message(message.role, content)
    raise InvalidPromptError(
        f"message {index} is a {type(message).__name__}; use System/Human/AI/Tool messages or ChatMessage")

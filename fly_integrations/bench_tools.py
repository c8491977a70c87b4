"""``fly bench --suite tools``: BFCL function-calling turns through ``FlyChatModel.bind_tools``, as LangChain users
run them, beside llama.cpp decoding the same rendered prompt (the peer a CPU user would run). Registered with the
runtime's bench through the ``fly.bench`` entry point: the runtime knows nothing of LangChain."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from fly_integrations.langchain import FlyChatModel
from fly_integrations.params import adapter_name
from fly_integrations.prompting import render_prompt
from fly_integrations.tool_calls import HERMES, parse_tool_calls, tool_format
from fly_integrations.tools import conform_arguments
from fly_runtime import FlyEngine, GenerationConfig, ModelSettings
from fly_runtime.bench.runner import LLAMA_CPP, LlamaCpp, ModeSpec
from fly_runtime.bench.suites import Task
from fly_runtime.config import REQUEST_SETTINGS
from fly_runtime.errors import FlyError
from fly_runtime.loader import get_engine

# the reply metadata FlyChatModel reports, under the bench row's names
_STATS = ("mean_accepted", "acceptance_rate", "fly_forgiven", "target_forwards", "mean_k", "cached_tokens")


class ToolTurns:
    """Runs one turn in one mode and returns the bench row: stats, the reply's text and its parsed calls."""

    def __init__(self, engine: FlyEngine, settings: ModelSettings, base: GenerationConfig,
                 llama: LlamaCpp | None = None) -> None:
        self.engine, self.settings, self.base, self.llama = engine, settings, base, llama
        self.models: dict[str, FlyChatModel] = {}

    def __call__(self, spec: ModeSpec, task: Task) -> dict:
        if spec.mode == LLAMA_CPP:
            return self._llama(task)
        if spec.mode not in ("ar", "exact", "fly"):
            raise FlyError(f"the tools suite runs ar, exact, fly and llama-cpp, not {spec.mode}")
        model = self._model(spec)
        get_engine(model.model_settings()).clear_cache()  # every run reads its whole prompt, as the peer does
        start = time.perf_counter()
        message = model.bind_tools(task.reference["tools"]).invoke(task.messages)
        seconds = time.perf_counter() - start
        meta, usage = message.response_metadata, message.usage_metadata or {}
        calls = [{"name": c["name"], "arguments": c["args"]} for c in message.tool_calls]
        return {"new_tokens": usage.get("output_tokens", 0), "prompt_tokens": usage.get("input_tokens"),
                "seconds": seconds, **{name: meta.get(name) for name in _STATS},
                "invalid_tool_calls": len(message.invalid_tool_calls), "tool_calls": calls,
                "text": message.content if isinstance(message.content, str) else json.dumps(message.content)}

    def _model(self, spec: ModeSpec) -> FlyChatModel:
        if spec.label not in self.models:
            config = replace(self.base, mode=spec.mode, k=spec.k)
            settings = {adapter_name(name): getattr(config, name) for name in REQUEST_SETTINGS}
            s = self.settings
            self.models[spec.label] = FlyChatModel(target=s.target, draft=s.draft, backend=s.backend, device=s.device,
                                                   precision=spec.precision or s.precision, **settings)
        return self.models[spec.label]

    def _llama(self, task: Task) -> dict:
        """llama.cpp on the prompt FlyChatModel renders, its reply parsed by the same parser."""
        if self.llama is None:
            raise FlyError("the llama-cpp mode needs the target's GGUF")
        tokenizer, tools = self.engine.tokenizer, task.reference["tools"]
        prompt = render_prompt(tokenizer, task.messages, tools)
        row = self.llama.generate(prompt.token_ids, self.base.max_new_tokens, set(self.engine.eos_token_ids), tokenizer)
        parameters = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
        parsed = parse_tool_calls(prompt.prefill + row["text"], set(parameters), tool_format(tokenizer) or HERMES)
        calls = [{"name": c.name, "arguments": conform_arguments(c.arguments, parameters[c.name])}
                 for c in parsed.calls]
        return {**row, "prompt_tokens": len(prompt.token_ids), "invalid_tool_calls": len(parsed.invalid),
                "tool_calls": calls, "text": parsed.content}

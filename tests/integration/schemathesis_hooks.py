"""schemathesis hooks for test_server_fuzz: leave out generated bodies that break a rule spanning two fields,
which JSON Schema cannot state (the document says each in words): a named tool_choice must name a bound tool,
in FLy mode the window must be below k, a request's own context_window must hold its prompt and
max_tokens, and an embeddings request's dimensions must be its model's. Every other rule is the document's own. (schemathesis applies body
hooks to its generated phases, not to its coverage phase, which therefore runs without the acceptance check.)"""

import schemathesis

from fly_runtime.config import DEFAULT_K, GenerationConfig


PROMPT_ALLOWANCE = 1024  # tokens a generated prompt may take (short strings, however exotic their characters)


@schemathesis.hook
def filter_body(context, body) -> bool:
    if not isinstance(body, dict):
        return True
    if "input" in body and body.get("dimensions") is not None:  # must equal the loaded embedding model's own
        return False
    choice, tools = body.get("tool_choice"), body.get("tools")
    if isinstance(choice, dict) and isinstance(choice.get("function"), dict):
        names = [t.get("function", {}).get("name") for t in tools or [] if isinstance(t, dict)
                 and isinstance(t.get("function"), dict)]
        if choice["function"].get("name") not in names:
            return False
    window_size = body.get("context_window")
    if isinstance(window_size, (int, float)) and not isinstance(window_size, bool):
        budget = body.get("max_tokens") or body.get("max_completion_tokens") or 16
        if not isinstance(budget, (int, float)) or budget + PROMPT_ALLOWANCE > window_size:
            return False
    mode, k, window = body.get("mode", "fly"), body.get("k"), body.get("window", GenerationConfig.window)
    numbers = (int, float)
    if mode == "fly" and isinstance(window, numbers) and isinstance(k or 0, numbers) and not isinstance(window, bool):
        return window < (k or DEFAULT_K["fly"])
    return True

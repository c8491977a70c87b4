"""`fly serve`: an OpenAI-compatible server over the FLy engine, or a vLLM launch with FLy's settings."""

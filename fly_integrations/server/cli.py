"""The `fly serve` command, registered with the `fly` CLI through the ``fly.commands`` entry point (the runtime's
CLI knows nothing of web frameworks)."""

from __future__ import annotations

import argparse
import ipaddress
import os
import subprocess
import sys

from fly_runtime.config import REQUEST_SETTINGS
from fly_runtime.errors import FlyError

LOOPBACK = ("localhost",)


def register(sub, add_model_args, add_decoding_args) -> None:
    serve = sub.add_parser("serve", help="an OpenAI-compatible server (/v1/chat/completions, /v1/completions, "
                                                 "/v1/embeddings, /metrics)")
    add_model_args(serve)
    add_decoding_args(serve)
    serve.set_defaults(max_new_tokens=512)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (another than loopback needs --api-key)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-key", default=os.environ.get("FLY_API_KEY"),
                       help="require 'Authorization: Bearer KEY' (default: $FLY_API_KEY)")
    serve.add_argument("--queue-depth", type=int, default=16,
                       help="requests that may wait for the model; more are refused with 429 and Retry-After")
    serve.add_argument("--request-timeout", type=float, default=None,
                       help="seconds a request may wait and run (a request may ask for less with 'timeout')")
    serve.add_argument("--max-body-mb", type=float, default=4.0, help="largest request body (413 beyond it)")
    serve.add_argument("--embedding-model", default="all-MiniLM-L6-v2",
                       help="/v1/embeddings' sentence-transformers model: a folder, a cached Hub id, or 'none' "
                            "(default: the bundled all-MiniLM-L6-v2, loaded on the first embeddings request)")
    serve.add_argument("--engine", choices=["fly", "vllm"], default="fly",
                       help="fly: this process serves the model; vllm: start `vllm serve` with FLy's settings")
    serve.add_argument("--tensor-parallel-size", type=int, default=1, help="with --engine vllm")
    serve.add_argument("--pipeline-parallel-size", type=int, default=1, help="with --engine vllm")
    serve.add_argument("--dry-run", action="store_true", help="with --engine vllm: print the command, start nothing")
    serve.set_defaults(func=run)


def is_loopback(host: str) -> bool:
    if host in LOOPBACK:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run(args: argparse.Namespace) -> int:
    from fly_runtime.cli import _config, _model_settings

    config = _config(args)  # every setting is checked before anything loads
    if not is_loopback(args.host) and not args.api_key:
        raise FlyError(f"binding to {args.host} exposes the model beyond this machine: pass --api-key (or set "
                       "FLY_API_KEY), or bind to 127.0.0.1")
    if args.queue_depth < 0 or args.max_body_mb <= 0:
        raise FlyError("--queue-depth must be >= 0 and --max-body-mb > 0")
    settings = _model_settings(args)
    if args.engine == "vllm":
        from fly_integrations.server.vllm import NOT_IN_VLLM, vllm_command
        from fly_runtime.loader import AUTO_DRAFT

        draft = settings.draft
        if draft == AUTO_DRAFT:
            if config.mode != "ar":
                raise FlyError("--engine vllm needs --draft HUB_ID (a drafter with the target's tokenizer that vLLM "
                               "can load), or --draft none for prompt-lookup drafting")
            draft = None
        command = vllm_command(settings.target, draft, config, args.host, args.port, args.api_key,
                               args.tensor_parallel_size, args.pipeline_parallel_size)
        print(" ".join(_quoted(c) for c in command))
        if args.dry_run:
            return 0
        print(f"fly: {NOT_IN_VLLM}", file=sys.stderr)
        try:
            return subprocess.call(command)
        except FileNotFoundError:
            raise FlyError("vllm is not installed here: install it on the GPU machine (pip install vllm)") from None
    one_malloc_arena()
    import uvicorn

    from fly_integrations.params import FlyParams, adapter_name
    from fly_integrations.server.app import ServerSettings, create_app

    # the command line's settings are the defaults of every request
    params = FlyParams(target=settings.target, draft=settings.draft, backend=settings.backend,
                       device=settings.device, precision=settings.precision, max_batch=settings.max_batch,
                       **{adapter_name(name): getattr(config, name) for name in REQUEST_SETTINGS})
    print(f"fly: loading {settings.target} ...", file=sys.stderr, flush=True)
    embedding = None if args.embedding_model.lower() == "none" else args.embedding_model
    app = create_app(params, ServerSettings(args.api_key, args.queue_depth, args.request_timeout,
                                            int(args.max_body_mb * 1024 * 1024), embedding))
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0


M_ARENA_MAX = -8  # glibc's mallopt parameter


def one_malloc_arena() -> bool:
    """Every thread of the server allocates from glibc's main arena (unless ``MALLOC_ARENA_MAX`` says otherwise).
    Why: the server's threads (requests, the engine, llama.cpp's) each got an arena of their own, and what they freed
    stayed in them: a served default with every form open peaked at 5.13 GB, and at 4.97 GB with one arena, its
    replies as fast (docs/benchmarks.md, 2026-12-07). Returns whether it was set (glibc only)."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    import ctypes
    import ctypes.util

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_ARENA_MAX, 1))
    except (OSError, AttributeError):  # not glibc (musl, macOS): its allocator as it is
        return False


def _quoted(part: str) -> str:
    return f"'{part}'" if any(c in part for c in " {}\"") else part

"""The ``fly`` command: generate text, manage the model cache, benchmark."""

from __future__ import annotations

import argparse
import json
import sys

from fly_runtime.config import GenerationConfig
from fly_runtime.errors import FlyError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from fly_runtime.loader import DEFAULT_DRAFT, DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: built-in name, dir, .gguf, Hub id")
    parser.add_argument("--draft", default=DEFAULT_DRAFT,
                        help="drafter model (same tokenizer as the target), or 'none' for prompt-lookup only")
    parser.add_argument("--backend", choices=["auto", "torch", "onnx"], default="auto",
                        help="auto: ONNX Runtime on CPU, PyTorch on CUDA")
    parser.add_argument("--device", default=None, help="PyTorch device (cpu, cuda, cuda:1)")


def _add_decoding_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=["ar", "exact", "fly"], default="fly")
    parser.add_argument("--k", type=int, default=None, help="drafts per round (default: 5 exact, 8 fly)")
    parser.add_argument("--window", type=int, default=6, help="FLy deferred window W")
    parser.add_argument("--entropy-threshold", type=float, default=0.3, help="FLy entropy gate θ")
    parser.add_argument("--ngram", action=argparse.BooleanOptionalAction, default=True,
                        help="check prompt-lookup n-grams with the drafter before it drafts alone")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=None)


def _config(args: argparse.Namespace, **extra) -> GenerationConfig:
    return GenerationConfig(
        mode=args.mode, k=args.k, window=args.window, entropy_threshold=args.entropy_threshold, ngram=args.ngram,
        max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        seed=args.seed, **extra,
    )


def _model_settings(args: argparse.Namespace):
    from fly_runtime.loader import ModelSettings

    draft = None if args.draft.lower() == "none" else args.draft
    return ModelSettings(target=args.target, draft=draft, backend=args.backend, device=args.device)


def cmd_generate(args: argparse.Namespace) -> int:
    from fly_runtime.loader import get_engine

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = _config(args, stop=tuple(args.stop or ()))  # settings are checked before any model loads
    if not prompt.strip():
        raise FlyError("the prompt is empty: pass some text (or '-' to read it from stdin)")
    engine = get_engine(_model_settings(args))
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                   [{"role": "user", "content": prompt}]
        prompt_ids = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    else:
        prompt_ids = engine.tokenizer.encode(prompt)
    stream = engine.stream(prompt_ids, config)
    for piece in stream:
        if not args.json:
            print(piece, end="", flush=True)
    result = stream.result
    assert result is not None
    stats = result.stats.as_dict()
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "stats": stats}))
    else:
        print()
        print(f"[{args.mode}] {result.stats.new_tokens} tokens in {result.stats.seconds:.2f} s "
              f"({result.stats.tokens_per_second:.1f} tok/s), τ={result.stats.mean_accepted:.2f}, "
              f"acceptance={result.stats.acceptance_rate:.2f}, forgiven={result.stats.fly_forgiven}",
              file=sys.stderr)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from fly_runtime.sources import BUILTIN_MODELS, BUILTIN_PAIRS, DEFAULT_PAIR, cache_dir, resolve_model
    from fly_runtime.sources.builtin import gguf_path

    if args.action == "list":
        print(f"cache: {cache_dir()}")
        for name, spec in BUILTIN_MODELS.items():
            state = "fetched" if gguf_path(spec).is_file() else "not fetched"
            print(f"  {name:32} {spec.size / 1e9:5.2f} GB  {state:11}  {spec.description}")
        for name, (target, draft) in BUILTIN_PAIRS.items():
            default = " (default)" if name == DEFAULT_PAIR else ""
            print(f"  pair {name}: target {target}, draft {draft}{default}")
        return 0
    for name, int8 in _fetch_plan(args.names or [DEFAULT_PAIR], BUILTIN_PAIRS, args.int8):
        model = resolve_model(name)
        if args.action == "path":
            print(model.hf_dir)
            continue
        line = f"{name}: {model.hf_dir}"
        if args.onnx:
            line += f", ONNX {'int8' if int8 else 'fp32'} {model.onnx_dir(int8=int8)}"
        print(line)
    return 0


def _fetch_plan(names: list[str], pairs: dict[str, tuple[str, str]], int8: bool) -> list[tuple[str, bool]]:
    """(model, int8 export?) for each name; a pair is its fp32 target and its int8 drafter."""
    plan: list[tuple[str, bool]] = []
    for name in names:
        if name in pairs:
            target, draft = pairs[name]
            plan += [(target, False), (draft, True)]
        else:
            plan.append((name, int8))
    return plan


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fly", description="FLy loosely speculative decoding for local LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply (streamed) with the FLy engine")
    _add_model_args(gen)
    _add_decoding_args(gen)
    gen.add_argument("--stop", action="append", help="stop string (repeatable); may span several tokens")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--chat", dest="chat", action="store_true", default=True, help="apply the chat template")
    gen.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as plain text")
    gen.add_argument("prompt", help="the prompt, or '-' to read it from stdin")
    gen.set_defaults(func=cmd_generate)

    models = sub.add_parser("models", help="list, fetch or locate models")
    models.add_argument("action", choices=["list", "fetch", "path"])
    models.add_argument("names", nargs="*", help="built-in model or pair names, dirs, .gguf files, Hub ids")
    models.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True,
                        help="with fetch: also export to ONNX Runtime (a pair: fp32 target, int8 drafter)")
    models.add_argument("--int8", action="store_true", help="with fetch --onnx of a single model: int8 export")
    models.set_defaults(func=cmd_models)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FlyError as exc:
        print(f"fly: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())

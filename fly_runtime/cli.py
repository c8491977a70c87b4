"""The ``fly`` command: generate text, manage the model cache, benchmark."""

from __future__ import annotations

import argparse
import json
import os
import sys

from fly_runtime.bench.suites import SUITES
from fly_runtime.config import MODES, REQUEST_SETTINGS, GenerationConfig
from fly_runtime.errors import FlyError


def _add_model_args(parser: argparse.ArgumentParser) -> None:
    from fly_runtime.loader import AUTO_DRAFT, DEFAULT_TARGET

    parser.add_argument("--target", default=DEFAULT_TARGET, help="target model: built-in name, dir, .gguf, Hub id")
    parser.add_argument("--draft", default=AUTO_DRAFT,
                        help="drafter model (same tokenizer as the target), 'none' for prompt lookup only, or 'auto': "
                             "the one fly knows for the target")
    parser.add_argument("--backend", choices=["auto", "torch", "onnx"], default="auto",
                        help="auto: ONNX Runtime on CPU, PyTorch on CUDA")
    parser.add_argument("--device", default=None, help="PyTorch device (cpu, cuda, cuda:1)")
    parser.add_argument("--precision", choices=["auto", "fp32", "int8", "int4", "gguf"], default="auto",
                        help="the target on the CPU: an ONNX Runtime graph (fp32, int8, int4), its GGUF under "
                             "llama.cpp (gguf), or auto: the fastest here that agrees with the model")
    parser.add_argument("--max-batch", type=int, default=None,
                        help="requests decoded together in one target pass (a llama.cpp target; others take turns); "
                             "default: as many as pay on this machine, measured once")


def _add_decoding_args(parser: argparse.ArgumentParser, exclude: tuple[str, ...] = ()) -> None:
    """One --flag-name per request setting (config.REQUEST_SETTINGS), defaulting as GenerationConfig does."""
    defaults = GenerationConfig()
    for name, help_text in REQUEST_SETTINGS.items():
        if name in exclude:
            continue
        flag, default = "--" + name.replace("_", "-"), getattr(defaults, name)
        if name == "mode":
            parser.add_argument(flag, choices=MODES, default=default, help=help_text)
        elif isinstance(default, bool):
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=default, help=help_text)
        else:  # k and seed default to None and take integers
            parser.add_argument(flag, type=int if default is None else type(default), default=default, help=help_text)


def _config(args: argparse.Namespace, **extra) -> GenerationConfig:
    settings = {name: getattr(args, name) for name in REQUEST_SETTINGS if hasattr(args, name)}
    return GenerationConfig(**settings, **extra)


def _model_settings(args: argparse.Namespace):
    from fly_runtime.loader import ModelSettings

    draft = None if args.draft.lower() == "none" else args.draft
    return ModelSettings(target=args.target, draft=draft, backend=args.backend, device=args.device,
                         precision=args.precision, max_batch=args.max_batch)


LONG_PROMPT = 1024  # tokens: the CLI says it is reading a prompt longer than this (seconds on a CPU)


def cmd_generate(args: argparse.Namespace) -> int:
    from dataclasses import replace

    from fly_runtime.chat import chat_encoder, encode_chat
    from fly_runtime.loader import get_engine

    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    config = _config(args, stop=tuple(args.stop or ()), timeout=args.timeout)  # checked before any model loads
    if not prompt.strip():
        raise FlyError("the prompt is empty: pass some text (or '-' to read it from stdin)")

    def encode(tokenizer) -> list[int]:
        if args.chat:
            messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
                       [{"role": "user", "content": prompt}]
            return encode_chat(tokenizer, messages)  # the prompt's text never becomes role tokens
        return chat_encoder(tokenizer).encode_text(prompt)

    settings = _model_settings(args)
    if settings.max_batch is None:  # one request: nothing to decode beside it, no batch size to time
        settings = replace(settings, max_batch=1)
    pinned = tokenizer = None
    if settings.precision == "auto":  # one request: only the form that serves it soonest is opened
        from fly_runtime.backends.registry import load_tokenizer
        from fly_runtime.loader import form_for_one_request
        from fly_runtime.sources import resolve_model

        tokenizer = load_tokenizer(resolve_model(settings.target))  # handed to the engine: loaded once
        pinned = form_for_one_request(settings, len(encode(tokenizer)), config)
        settings = replace(settings, precision=pinned) if pinned else settings
    engine = get_engine(settings, tokenizer)
    prompt_ids = encode(engine.tokenizer)
    if len(prompt_ids) > LONG_PROMPT and not args.json:
        # the read runs in chunks: Ctrl-C and --timeout take effect within one of them
        print(f"fly: reading the {len(prompt_ids):,}-token prompt ...", file=sys.stderr, flush=True)
    stream = engine.stream(prompt_ids, config)
    for piece in stream:
        if not args.json:
            print(piece, end="", flush=True)
    result = stream.result
    assert result is not None
    stats = result.stats.as_dict()
    ran_on = result.form or pinned
    if args.json:
        print(json.dumps({"text": result.text, "token_ids": result.token_ids,
                          "finish_reason": result.finish_reason, "form": ran_on, "stats": stats}))
    else:
        print()
        form = f" on {ran_on}" if ran_on else ""
        print(f"[{args.mode}{form}] {result.stats.new_tokens} tokens in {result.stats.seconds:.2f} s "
              f"({result.stats.tokens_per_second:.1f} tok/s), τ={result.stats.mean_accepted:.2f}, "
              f"acceptance={result.stats.acceptance_rate:.2f}, forgiven={result.stats.fly_forgiven}, "
              f"mean K={result.stats.mean_k:.1f}, plain steps={result.stats.plain_steps}",
              file=sys.stderr)
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from dataclasses import replace
    from pathlib import Path

    from fly_runtime.bench.runner import HF_ASSISTED, LLAMA_CPP, HfAssisted, LlamaCpp, ModeSpec, run_benchmark
    from fly_runtime.bench.suites import default_data_dir, load_tasks
    from fly_runtime.loader import get_engine
    from fly_runtime.sources import resolve_model

    modes = [ModeSpec.parse(m.strip()) for m in args.modes.split(",") if m.strip()]
    base = _config(args)
    for spec in modes:  # every mode's settings are checked before anything loads
        if spec.mode not in (HF_ASSISTED, LLAMA_CPP):
            replace(base, mode=spec.mode, k=spec.k)  # validates, as construction does
    if args.skip < 0:
        raise FlyError(f"--skip must be >= 0, got {args.skip}")
    if args.agent_steps < 3:
        raise FlyError(f"--agent-steps must be >= 3 (a model call, its tool's run, the call that reads the result), "
                       f"got {args.agent_steps}")
    if args.suite in ("tools", "agent") and any(spec.mode == HF_ASSISTED for spec in modes):
        raise FlyError(f"the {args.suite} suite runs its turns through LangChain: use ar, exact, fly and llama-cpp "
                       "modes (hf-assisted has no tool calling)")
    data = Path(args.data) if args.data else None if args.suite == "agent" else default_data_dir()  # agent: built in
    tasks = load_tasks(args.suite, data, args.limit, args.per_category, args.skip)
    if not tasks:
        raise FlyError("no prompts selected: check --limit / --per-category / --skip")
    settings = _model_settings(args)
    engine = get_engine(settings)
    hf = None
    if any(spec.mode == HF_ASSISTED for spec in modes):
        if engine.draft_name is None:
            raise FlyError("hf-assisted needs a draft model: pass --draft")
        hf = HfAssisted(resolve_model(settings.target).weights(), resolve_model(engine.draft_name).weights())
    llama = None
    if any(spec.mode == LLAMA_CPP for spec in modes):
        gguf = resolve_model(settings.target).gguf
        if gguf is None:
            raise FlyError("llama-cpp runs the target's GGUF: pass a built-in model or a .gguf file as --target")
        llama = LlamaCpp(gguf)
    engines = {spec.precision: get_engine(replace(settings, precision=spec.precision))
               for spec in modes if spec.precision}
    described = {"target": settings.target, "draft": engine.draft_name, "backend": engine.target.backend.name,
                 **{name: getattr(base, name) for name in REQUEST_SETTINGS if name not in ("mode", "max_new_tokens", "seed")}}
    options = {"steps": args.agent_steps} if args.suite == "agent" else {}
    run_task = _suite_runner(args.suite, engine, settings, base, llama, **options)
    run_benchmark(engine, tasks, modes, base, args.suite, Path(args.out), hf, described, llama, engines, run_task)
    print((Path(args.out) / "summary.md").read_text())
    return 0


def _suite_runner(suite: str, *args, **options):
    """The runner of a suite whose turns go through an integration (suites.registered_runner), else None."""
    from fly_runtime.bench.suites import registered_runner

    runner = registered_runner(suite)
    return runner(*args, **options) if runner is not None else None


def cmd_models(args: argparse.Namespace) -> int:
    if args.action == "list":
        return _list_models()
    if args.action == "prune":
        return _prune()
    from fly_runtime.sources import BUILTIN_PAIRS, DEFAULT_PAIR, resolve_model

    for name in args.names or [DEFAULT_PAIR]:
        target, draft = BUILTIN_PAIRS.get(name, (name, None))
        model = resolve_model(target)
        if args.action == "path":
            print(model.hf_dir)
            continue
        if not args.onnx:
            print(f"{model.name}: {model.hf_dir}")
            continue
        precision = args.precision
        if precision == "auto":
            from fly_runtime.tuning import choose_precision

            precision = choose_precision(model)
        print(_fetch_form(model, precision, args.keep_weights))
        if draft is not None:
            print(_fetch_drafter(model, precision, draft, args.keep_weights))
    return 0


def _fetch_form(model, precision: str, keep_weights: bool) -> str:
    """Build ``model``'s target form at ``precision``; a line saying what is where."""
    line = f"{model.name}: {model.hf_dir}" + (f", the GGUF under llama.cpp ({model.gguf})" if precision == "gguf"
                                               else f", ONNX {precision} {model.build_onnx(precision)}")
    if model.gguf is not None and not keep_weights:
        _drop_weights(model)
    return line


def _fetch_drafter(target, precision: str, draft: str, keep_weights: bool) -> str:
    """A pair's drafter (int4 graph) where model drafts can pay beside the target at ``precision`` here; else a
    line saying why it is not fetched (``fly models fetch DRAFTER --precision int4`` fetches it anyway)."""
    from fly_runtime.loader import open_target
    from fly_runtime.sources import resolve_model
    from fly_runtime.tuning import drafter_share, pass_costs, pass_prices

    prices = pass_prices(pass_costs(lambda: open_target(target, precision), target, precision),
                         drafter_share(target.name, draft, precision))
    if not prices.model_drafts_pay():
        return (f"{draft}: not fetched: beside the {precision} target here a drafted token costs "
                f"{prices.row / prices.step:.2f} of a step to verify and about {prices.draft / prices.step:.2f} to "
                "draft, so model drafts cannot pay (prompt lookup drafts instead)")
    return _fetch_form(resolve_model(draft), "int4", keep_weights)


def _list_models() -> int:
    from fly_runtime.sources import BUILTIN_MODELS, BUILTIN_PAIRS, DEFAULT_PAIR, cache_dir
    from fly_runtime.sources.builtin import gguf_path, is_verified
    from fly_runtime.sources.inventory import inventory
    from fly_runtime.tuning import BF16_PRODUCT, describe, forms_in_use, load_records, machine_id

    print(f"cache: {cache_dir()}")
    for name, spec in BUILTIN_MODELS.items():
        path = gguf_path(spec)
        # a file whose size or marker does not match is re-checked (or fetched anew) on its next load
        state = "fetched" if is_verified(spec, path) else "to verify" if path.exists() else "not fetched"
        print(f"  {name:32} {spec.size / 1e9:5.2f} GB  {state:11}  {spec.description}")
    for name, (target, draft) in BUILTIN_PAIRS.items():
        default = " (default)" if name == DEFAULT_PAIR else ""
        print(f"  pair {name}: target {target}, draft {draft}{default}")
    print(f"machine: {machine_id()}")
    for key, record in load_records().items():
        if not key.startswith(machine_id() + "|"):
            continue
        if key == f"{machine_id()}|{BF16_PRODUCT}":
            print(f"  a bfloat16 product {record['ms']:.1f} ms: prices the prompt reader here ({record['date']})")
        elif "max_batch" in record:
            passes = ", ".join(f"{n}: {ms:.0f}" for n, ms in record["ms"].items())
            print(f"  {record['model']}: decodes up to {record['max_batch']} requests together (auto; one-token "
                  f"passes over that many requests, ms: {passes}; {record['date']})")
        elif key.endswith("|passes"):
            print(f"  {record['model']} at {record['precision']}: {describe(record['ms'])} ({record['date']})")
        else:
            print(f"  {record['model']}: target {record['precision']} (auto; {describe(record['ms'])}; {record['date']})")
    entries = inventory(forms_in_use())
    print(f"on disk: {sum(e.size for e in entries) / 1e9:.2f} GB")
    for entry in entries:
        print(f"  {entry.size / 1e9:6.2f} GB  {entry.path.relative_to(cache_dir())}: {entry.use}")
    unused = sum(e.size for e in entries if not e.needed)
    if unused:
        print(f"{unused / 1e9:.2f} GB of it is read by nothing that runs here: `fly models prune` deletes it")
    return 0


def _prune() -> int:
    from fly_runtime.sources.inventory import inventory, prune
    from fly_runtime.tuning import forms_in_use

    entries = inventory(forms_in_use())
    for entry in entries:
        if not entry.needed:
            print(f"fly: deleting {entry.path} ({entry.size / 1e9:.2f} GB; {entry.use})", file=sys.stderr)
    print(f"freed {prune(entries) / 1e9:.2f} GB")
    return 0


def _drop_weights(model) -> None:
    """After its graph is built, a GGUF model's float32 weights are the cache's largest file and nothing reads
    them (llama.cpp and the graphs have their own): drop them; a later torch backend or graph build converts
    them again."""
    from fly_runtime.sources.convert import drop_weights

    freed = drop_weights(model.hf_dir)
    if freed:
        print(f"fly: dropped {model.name}'s float32 weights ({freed / 1e9:.1f} GB; the GGUF holds them, and they are "
              "converted again if the torch backend or an fp32 graph needs them; --keep-weights keeps them)",
              file=sys.stderr)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fly", description="FLy loosely speculative decoding for local LLMs")
    parser.add_argument("--debug", action="store_true", help="show the traceback of an error")
    sub = parser.add_subparsers(dest="command", required=True)

    gen = sub.add_parser("generate", help="generate a reply (streamed) with the FLy engine")
    _add_model_args(gen)
    _add_decoding_args(gen)
    gen.add_argument("--stop", action="append", help="stop string (repeatable); may span several tokens")
    gen.add_argument("--system", default=None, help="system message (chat mode)")
    gen.add_argument("--timeout", type=float, default=None,
                     help="seconds the generation may run, prompt read included; it then ends (finish 'timeout')")
    gen.add_argument("--json", action="store_true", help="print one JSON object: text, token_ids, stats")
    gen.add_argument("--chat", dest="chat", action="store_true", default=True, help="apply the chat template")
    gen.add_argument("--raw", dest="chat", action="store_false", help="feed the prompt as plain text")
    gen.add_argument("prompt", help="the prompt, or '-' to read it from stdin")
    gen.set_defaults(func=cmd_generate)

    bench = sub.add_parser("bench", help="speed (Spec-Bench) and accuracy retention (GSM8K, HumanEval) per mode")
    _add_model_args(bench)
    _add_decoding_args(bench, exclude=("mode",))
    bench.set_defaults(max_new_tokens=128)
    bench.add_argument("--suite", choices=SUITES, default="spec-bench",
                       help="rag: Spec-Bench's rag and summarization prompts; tools: BFCL function-calling turns through "
                            "LangChain's bind_tools (scored); json: schema extraction (scored); agent: two-step tool tasks "
                            "through LangChain's create_agent, whole conversations timed (scored)")
    bench.add_argument("--limit", type=int, default=None, help="first N prompts")
    bench.add_argument("--skip", type=int, default=0,
                       help="leave out the first N prompts (with --limit: one shard of a long run)")
    bench.add_argument("--per-category", type=int, default=None, help="first N prompts of each category")
    bench.add_argument("--modes", default="ar,exact,fly",
                       help="comma-separated: ar, exact, fly, hf-assisted, llama-cpp (llama.cpp on the target's GGUF); "
                            "':kN' fixes K (fly:k10), ':int4' / ':int8' / ':fp32' / ':gguf' sets the target's precision "
                            "(ar:int4)")
    bench.add_argument("--agent-steps", type=int, default=12,
                       help="agent suite: each conversation's step limit (LangGraph's recursion_limit: a model call "
                            "and a tool run are a step each)")
    bench.add_argument("--data", default=None, help="folder with the benchmark files (default: ../shared/data)")
    bench.add_argument("--out", required=True, help="output folder")
    bench.set_defaults(func=cmd_bench)

    models = sub.add_parser("models", help="list (with what the cache holds and why), fetch, locate or prune models")
    models.add_argument("action", choices=["list", "fetch", "path", "prune"],
                        help="prune: delete what nothing that runs here reads (float32 weights, graphs not chosen, "
                             "unfinished downloads)")
    models.add_argument("names", nargs="*", help="built-in model or pair names, dirs, .gguf files, Hub ids")
    models.add_argument("--onnx", action=argparse.BooleanOptionalAction, default=True,
                        help="with fetch: also build the target's form (a pair: its target, timed once per machine "
                             "for --precision auto, and its int4 drafter where model drafts can pay beside it)")
    models.add_argument("--keep-weights", action="store_true",
                        help="with fetch: keep the float32 weights converted from a GGUF once its graph is built "
                             "(for backend='torch'; about 4 bytes a parameter)")
    models.add_argument("--precision", choices=["auto", "fp32", "int8", "int4", "gguf"], default="auto",
                        help="with fetch --onnx: the graph precision (auto: time the candidates on this machine)")
    models.set_defaults(func=cmd_models)
    # commands that live above the runtime (`fly serve`, in fly_integrations) register through an entry point
    from importlib.metadata import entry_points

    for command in entry_points(group="fly.commands"):
        command.load()(sub, _add_model_args, _add_decoding_args)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except FlyError as exc:
        if args.debug:
            raise
        print(f"fly: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (`fly generate ... | head`): end quietly, as Unix tools do
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush at exit
        return 141
    except Exception as exc:  # a fault of fly's own, or of a library under it: one line unless asked for more
        if args.debug:
            raise
        print(f"fly: internal error: {type(exc).__name__}: {exc} (run with --debug for the traceback, and please "
              "report it)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

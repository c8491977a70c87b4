"""What each form of a target adds to a process's memory, opened one after another as a served default opens them:
resident memory (anonymous and file-backed) after opening each form and after it reads a prompt and takes a few
steps. Where the served default's peak comes from (docs/benchmarks.md).

    HF_HUB_OFFLINE=1 python scripts/form_memory.py --forms int4,reader,gguf [--read 600]
"""

from __future__ import annotations

import argparse
from pathlib import Path

FORMS = ("int4", "int8", "gguf", "reader", "draft")


def memory() -> dict[str, float]:
    """This process's resident memory, GB: all, anonymous, file-backed, and the peak so far."""
    fields = {"VmRSS:": "rss", "RssAnon:": "anon", "RssFile:": "file", "VmHWM:": "peak"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, *value = line.split()
        if key in fields:
            out[fields[key]] = int(value[0]) / 1e6
    return out


def report(what: str) -> None:
    m = memory()
    print(f"{what:34s} rss {m['rss']:5.2f}  anon {m['anon']:5.2f}  file {m['file']:5.2f}  peak {m['peak']:5.2f} GB",
          flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--forms", default="int4,reader,gguf",
                        help=f"comma-separated, opened in this order: {', '.join(FORMS)}")
    parser.add_argument("--read", type=int, default=600, help="prompt tokens each form reads after opening")
    parser.add_argument("--steps", type=int, default=20, help="one-token steps after the read")
    args = parser.parse_args()
    forms = args.forms.split(",")
    if unknown := set(forms) - set(FORMS):
        parser.error(f"unknown forms {sorted(unknown)}: choose from {', '.join(FORMS)}")

    report("start")
    from fly_runtime.backends.bf16_reader import PromptReader
    from fly_runtime.backends.registry import open_target
    from fly_runtime.loader import DEFAULT_DRAFT, DEFAULT_TARGET, ROUTED_CONTEXT, load_tokenizer
    from fly_runtime.sources import resolve_model
    from fly_runtime.sources.cache import cache_dir
    from fly_runtime.tuning import BATCH_CANDIDATES

    report("imports")
    model = resolve_model(DEFAULT_TARGET)
    tokenizer = load_tokenizer(model)
    report("tokenizer")
    text = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    ids = tokenizer.encode(text)[: args.read + 1]
    held = []
    for form in forms:
        if form == "reader":
            reader = PromptReader(model.gguf, cache_dir() / "reader")
            report("opened the prompt reader")
            reader.read(ids[: args.read])
            report(f"  read {args.read}")
            held.append(reader)
            continue
        if form == "draft":
            backend = open_target(resolve_model(DEFAULT_DRAFT), "int4")
        elif form == "gguf":
            # as a routed engine holds it
            backend = open_target(model, "gguf", sequences=max(BATCH_CANDIDATES), context=ROUTED_CONTEXT)
        else:
            backend = open_target(model, form)
        report(f"opened {form}")
        backend.forward(ids[: args.read], keep=1)
        for i in range(args.steps):
            backend.forward([ids[i]])
        report(f"  read {args.read} + {args.steps} steps")
        held.append(backend)


if __name__ == "__main__":
    main()

"""Run modes interleaved per prompt, write results.jsonl, summary.json / summary.md and speed.png."""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tqdm.auto import tqdm

from fly_runtime.backends.openmp_thread import on_openmp_thread
from fly_runtime.bench.suites import SCORERS, Task
from fly_runtime.chat import encode_chat
from fly_runtime.config import GenerationConfig
from fly_runtime.engine import FlyEngine, GenerationStats
from fly_runtime.errors import FlyError
from fly_runtime.sources.convert import TARGET_PRECISIONS as PRECISIONS
from fly_runtime.timing import pass_seconds

HF_ASSISTED = "hf-assisted"
LLAMA_CPP = "llama-cpp"


@dataclass(frozen=True)
class ModeSpec:
    """A mode to benchmark: ``ar``, ``exact``, ``fly``, ``hf-assisted`` or ``llama-cpp``, with options after colons:
    a fixed K (``fly:k10``) and the target's precision (``ar:int4``; default: the run's ``--precision``)."""

    label: str
    mode: str
    k: int | None = None
    precision: str | None = None

    @classmethod
    def parse(cls, text: str) -> "ModeSpec":
        name, *options = text.split(":")
        if name not in ("ar", "exact", "fly", HF_ASSISTED, LLAMA_CPP):
            raise ValueError(f"unknown mode {name!r}: use ar, exact, fly, hf-assisted, llama-cpp (options :kN, "
                             f":{'/:'.join(PRECISIONS)})")
        k = precision = None
        for option in options:
            if option in PRECISIONS:
                precision = option
            elif option.startswith("k") and option[1:].isdigit():
                k = int(option[1:])
            else:
                raise ValueError(f"mode option {option!r} must look like k8 or name a precision "
                                 f"({', '.join(PRECISIONS)})")
        return cls(text, name, k, precision)

    @property
    def plain(self) -> bool:
        """Plain decoding of the target (a baseline for speedups): ar at any precision, or llama.cpp."""
        return self.mode in ("ar", LLAMA_CPP)


class HfAssisted:
    """transformers' assisted generation on the same pair in PyTorch: the baseline users would pick instead."""

    def __init__(self, target_dir: Path, draft_dir: Path) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        self.torch = torch
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=torch.float32).eval()

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int], tokenizer) -> dict:
        torch = self.torch
        ids = torch.tensor([prompt_ids])
        start = time.perf_counter()
        with torch.inference_mode():
            out = self.target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=self.draft,
                                       max_new_tokens=max_new_tokens, do_sample=False,
                                       eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0])
        seconds = time.perf_counter() - start
        new = out[0, len(prompt_ids):].tolist()
        for i, t in enumerate(new):
            if t in eos:
                new = new[:i]
                break
        return _peer_row(new, seconds, tokenizer, plain=False)


class LlamaCpp:
    """llama.cpp (llama-cpp-python) decoding the same GGUF plainly and greedily: the peer a CPU user would run.

    It gets the prompt ids fly gets (the GGUF's vocabulary is the target's), reads the whole prompt each run
    (its own prefix reuse is reset, as fly's cache is cleared),
    and stops at the same end-of-sequence ids and token budget, so its rows compare with ``ar``'s.
    """

    def __init__(self, gguf: Path, context: int = 8192) -> None:
        try:
            from llama_cpp import Llama
        except ImportError as exc:
            raise FlyError("the llama-cpp mode needs llama-cpp-python: pip install 'fly-integrations[llama-cpp]' "
                           "(it builds llama.cpp, about 10 minutes once)") from exc
        threads = os.cpu_count()
        # on the thread fly's llama.cpp passes run on (openmp_thread.on_openmp_thread): a second thread driving
        # llama.cpp in one process slows both (OpenMP's spin-waits cut), as no user running llama.cpp alone sees
        self.llm = on_openmp_thread(lambda: Llama(model_path=str(gguf), n_ctx=context, n_threads=threads,
                                                 n_threads_batch=threads, verbose=False))

    def generate(self, prompt_ids: list[int], max_new_tokens: int, eos: set[int], tokenizer,
                 json_schema: str | None = None) -> dict:
        """``json_schema``: decode under llama.cpp's own grammar for the schema, as its users would."""
        grammar = None
        if json_schema is not None:
            from llama_cpp import LlamaGrammar

            grammar = LlamaGrammar.from_json_schema(json_schema, verbose=False)
        new: list[int] = []
        # llama-cpp-python keeps the previous prompt's cache and reads only past the common prefix; fly's modes
        # start from an empty cache in the bench, so the peer does too
        self.llm.reset()

        def decode() -> None:
            for token in self.llm.generate(prompt_ids, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, reset=True,
                                           grammar=grammar):
                if token in eos:
                    break
                new.append(token)
                if len(new) >= max_new_tokens:
                    break

        start = time.perf_counter()
        on_openmp_thread(decode)
        return _peer_row(new, time.perf_counter() - start, tokenizer, plain=True)


def _peer_row(new: list[int], seconds: float, tokenizer, plain: bool) -> dict:
    """The result row of a decoder other than fly's engine, in the engine's row shape: plain decoding makes one
    target pass a token; what the peer does not report is None."""
    passes = len(new)
    row = GenerationStats(new_tokens=len(new), seconds=seconds, target_forwards=passes, plain_steps=passes).as_dict()
    unknown = ("drafted_tokens", "native_accepted", "fly_forgiven", "acceptance_rate", "mean_k", "lookup_rounds",
               "forced_tokens", "drafter_forwards", "prompt_tokens")
    if not plain:
        unknown += ("target_forwards", "plain_steps", "mean_accepted")
    return {**row, **dict.fromkeys(unknown), "text": tokenizer.decode(new, skip_special_tokens=True)}


def measure_verify_cost(engine: FlyEngine, context: int = 256, repeats: int = 5) -> dict:
    """Target cost of one decoding step vs one verification of 8 tokens, at a realistic context length."""
    sequence = engine.target
    with engine.exclusive():
        sequence.extend([engine.tokenizer.encode(" the")[0]] * context)
        step_ms, verify_ms = (pass_seconds(sequence.extend, sequence.crop, context, [42] * n, repeats) * 1000
                              for n in (1, 8))
    return {"step_ms": step_ms, "verify_8_ms": verify_ms, "ratio": verify_ms / step_ms}


def run_benchmark(
    engine: FlyEngine,
    tasks: list[Task],
    modes: list[ModeSpec],
    base: GenerationConfig,
    suite: str,
    out_dir: Path,
    hf: HfAssisted | None = None,
    settings: dict | None = None,
    llama: LlamaCpp | None = None,
    engines: dict[str, FlyEngine] | None = None,
    run_task: Callable[[ModeSpec, Task], dict] | None = None,
) -> dict:
    """Run every mode on every task, interleaved; ``engines`` serve modes that name a precision. ``run_task``
    runs a suite whose turns go through an integration (``tools``: LangChain's ``bind_tools``), returning the
    row's stats, ``text`` and what its scorer reads."""
    out_dir.mkdir(parents=True, exist_ok=True)
    scorer = SCORERS.get(suite)
    encode = lambda task: encode_chat(engine.tokenizer, task.messages)  # noqa: E731

    def run(spec: ModeSpec, ids: list[int], task: Task) -> dict:
        if run_task is not None:
            return run_task(spec, task)
        if spec.mode == HF_ASSISTED:
            assert hf is not None
            return hf.generate(ids, base.max_new_tokens, set(engine.eos_token_ids), engine.tokenizer)
        schema = json.dumps(task.reference["schema"]) if "schema" in task.reference else None
        if spec.mode == LLAMA_CPP:
            assert llama is not None
            return llama.generate(ids, base.max_new_tokens, set(engine.eos_token_ids), engine.tokenizer, schema)
        config = replace(base, mode=spec.mode, k=spec.k, json_schema=schema)
        runner = (engines or {})[spec.precision] if spec.precision else engine
        # every run reads its whole prompt, as Spec-Bench measures: the previous mode's run of the same prompt
        # must not leave it cached
        runner.clear_cache()
        result = runner.generate(ids, config)
        return {**result.stats.as_dict(), "text": result.text, "form": result.form}

    warmup = encode(tasks[0])
    for spec in modes:  # loads lazily-initialised kernels and caches; not counted
        if run_task is None:
            run(spec, warmup[: min(len(warmup), 64)], tasks[0])
        else:  # a suite's runner may warm up on less than a whole task (an agent: its first calls)
            getattr(run_task, "warm_up", run_task)(spec, tasks[-1])
    fly_engines = list({id(e): e for e in [engine, *(engines or {}).values()]}.values())
    for runner in fly_engines:
        if runner.history is not None:  # the warm-up's replies: a measured run of the same prompt would copy them
            runner.history.clear()
    settling = 0.0  # seconds waited for forms opening beside the requests (their time is no run's)

    rows = []
    with open(out_dir / "results.jsonl", "w") as log, \
            tqdm(total=len(tasks) * len(modes), desc=f"fly bench {suite}", unit="run") as bar:
        for task in tasks:
            ids = encode(task)
            for spec in modes:  # interleaved, so machine drift hits every mode alike
                began = time.perf_counter()
                for runner in fly_engines:  # a form opening beside fly's requests would slow the next run, any mode's
                    runner.settle()
                settling += time.perf_counter() - began
                row = {"task_id": task.task_id, "category": task.category, "mode": spec.label, **run(spec, ids, task)}
                row["tokens_per_second"] = row["new_tokens"] / row["seconds"] if row["seconds"] else 0.0
                if scorer:
                    row["correct"] = scorer(task, row)
                rows.append(row)
                log.write(json.dumps(row) + "\n")
                log.flush()
                bar.update()
    summary = summarise(rows, modes, suite, base, settings or {})
    summary["settled_seconds"] = settling
    summary["verify_cost"] = measure_verify_cost(engine)
    (out_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    (out_dir / "summary.md").write_text(render_markdown(summary))
    plot_speed(summary, out_dir / "speed.png")
    return summary


def _mean_ratio(rows: list[dict], baseline: dict[str, float]) -> float | None:
    ratios = [r["tokens_per_second"] / baseline[r["task_id"]] for r in rows if baseline.get(r["task_id"])]
    return statistics.mean(ratios) if ratios else None


def _aggregate(rows: list[dict], ar_by_task: dict[str, float], scored: bool,
               best_plain: dict[str, float] | None = None, best_wall: dict[str, float] | None = None) -> dict:
    tokens = sum(r["new_tokens"] for r in rows)
    seconds = sum(r["seconds"] for r in rows)
    forwards = [r.get("target_forwards") for r in rows]
    walls = [best_wall[r["task_id"]] / r["seconds"] for r in rows if (best_wall or {}).get(r["task_id"]) and r["seconds"]]
    out = {
        "tokens_per_second": tokens / seconds if seconds else 0.0,
        "seconds": seconds,
        # the best plain decoding's wall time over this mode's, per prompt: what a caller waits, whatever the
        # reply's length (a tool call written in fewer tokens is not slower)
        "wall_speedup_vs_best_plain": statistics.mean(walls) if walls else None,
        "speedup_vs_ar": _mean_ratio(rows, ar_by_task),
        "speedup_vs_best_plain": _mean_ratio(rows, best_plain or {}),
        "mean_accepted": sum(r["new_tokens"] for r in rows) / sum(forwards) if all(forwards) else None,
    }
    if scored:
        out["accuracy"] = sum(bool(r["correct"]) for r in rows) / len(rows)
    return out


def summarise(rows: list[dict], modes: list[ModeSpec], suite: str, base: GenerationConfig, settings: dict) -> dict:
    scored = suite in SCORERS
    ar_by_task = {r["task_id"]: r["tokens_per_second"] for r in rows if r["mode"] == "ar"}
    best_plain: dict[str, float] = {}  # per prompt, the fastest plain decoding: fly's ar at any precision, llama.cpp
    best_wall: dict[str, float] = {}  # and its shortest wall time
    plain = {m.label for m in modes if m.plain}
    for r in rows:
        if r["mode"] in plain:
            best_plain[r["task_id"]] = max(best_plain.get(r["task_id"], 0.0), r["tokens_per_second"])
            best_wall[r["task_id"]] = min(best_wall.get(r["task_id"], float("inf")), r["seconds"])
    categories = sorted({r["category"] for r in rows})
    summary = {
        "suite": suite,
        "n_prompts": len({r["task_id"] for r in rows}),
        "max_new_tokens": base.max_new_tokens,
        "machine": {"platform": platform.platform(), "processor": platform.processor() or platform.machine(),
                    "cpus": os.cpu_count(), "date": time.strftime("%Y-%m-%d")},
        "settings": settings,
        "overall": {m.label: _aggregate([r for r in rows if r["mode"] == m.label], ar_by_task, scored, best_plain,
                                        best_wall) for m in modes},
        "categories": {c: {m.label: _aggregate([r for r in rows if r["mode"] == m.label and r["category"] == c],
                                               ar_by_task, scored, best_plain, best_wall) for m in modes}
                       for c in categories},
    }
    if scored and "ar" in summary["overall"] and "fly" in summary["overall"]:
        ar_acc = summary["overall"]["ar"]["accuracy"]
        summary["fly_retention"] = summary["overall"]["fly"]["accuracy"] / ar_acc if ar_acc else None
    return summary


def _fmt(value: float | None, pattern: str) -> str:
    return "–" if value is None else pattern.format(value)


def render_markdown(summary: dict) -> str:
    modes = list(summary["overall"])
    scored = any("accuracy" in v for v in summary["overall"].values())
    head = "| category | " + " | ".join(f"{m} tok/s | {m} wall s | {m} vs ar | {m} vs best plain | "
                                        f"{m} wall vs best plain | {m} τ"
                                        + (f" | {m} acc" if scored else "") for m in modes) + " |"
    cells_per_mode = 7 if scored else 6
    lines = [f"# fly bench: {summary['suite']}", "",
             f"{summary['n_prompts']} prompts, {summary['max_new_tokens']} new tokens max, "
             f"{summary['machine']['cpus']} CPUs, {summary['machine']['date']}.", "",
             head, "|" + " --- |" * (1 + cells_per_mode * len(modes))]

    def row(name: str, stats: dict) -> str:
        cells = []
        for m in modes:
            s = stats[m]
            cells += [_fmt(s["tokens_per_second"], "{:.2f}"), _fmt(s.get("seconds"), "{:.1f}"),
                      _fmt(s["speedup_vs_ar"], "{:.2f}x"), _fmt(s["speedup_vs_best_plain"], "{:.2f}x"),
                      _fmt(s.get("wall_speedup_vs_best_plain"), "{:.2f}x"), _fmt(s["mean_accepted"], "{:.2f}")]
            if scored:
                cells.append(_fmt(s.get("accuracy"), "{:.1%}"))
        return f"| {name} | " + " | ".join(cells) + " |"

    lines += [row(c, s) for c, s in summary["categories"].items()]
    lines.append(row("**overall**", summary["overall"]))
    cost = summary.get("verify_cost")
    if cost:
        lines += ["", f"Target cost: one decoding step {cost['step_ms']:.1f} ms, verifying 8 tokens "
                      f"{cost['verify_8_ms']:.1f} ms ({cost['ratio']:.2f}x)."]
    if summary.get("fly_retention") is not None:
        lines += ["", f"FLy accuracy retention: {summary['fly_retention']:.1%} of `ar`."]
    return "\n".join(lines) + "\n"


def plot_speed(summary: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = [m for m in summary["overall"] if not ModeSpec.parse(m).plain]
    # against the best plain decoding where more than one plain mode ran, else against ar
    key = "speedup_vs_best_plain" if sum(ModeSpec.parse(m).plain for m in summary["overall"]) > 1 else "speedup_vs_ar"
    groups = [*summary["categories"], "overall"]
    stats = {**summary["categories"], "overall": summary["overall"]}
    width = 0.8 / max(len(modes), 1)
    fig, ax = plt.subplots(figsize=(max(8, len(groups) * 0.9), 4.5))
    for i, mode in enumerate(modes):
        values = [stats[g][mode][key] or 0 for g in groups]
        ax.bar([x + i * width for x in range(len(groups))], values, width, label=mode)
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
    ax.set_xticks([x + width * (len(modes) - 1) / 2 for x in range(len(groups))], groups, rotation=35, ha="right")
    ax.set_ylabel(f"{key.replace('_', ' ')} (mean of per-prompt ratios)")
    ax.set_title(f"fly bench {summary['suite']}: {summary['n_prompts']} prompts, "
                 f"{summary['max_new_tokens']} new tokens")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)

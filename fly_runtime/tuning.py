"""The target's precision for this machine, chosen by measurement once and kept in the cache.

Which precision decodes fastest depends on the CPU (instruction set, cores, memory bandwidth), so
``precision="auto"`` times a one-token step and a nine-token pass (a verification) of each candidate
graph, once per machine and model, and keeps the fastest step among the graphs that compute a token the
same way in a one-token step and inside a multi-token pass. Only those keep ``exact`` token-identical to
``ar``: a quantised kernel that rounds activations differently for one row than for several flips near-tied
tokens. The record lives in ``<cache>/tuning.json``; ``fly models list`` shows it and ``precision=...``
overrides it.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from pathlib import Path

from fly_runtime.sources.cache import cache_dir
from fly_runtime.timing import pass_seconds

# what auto may choose: precisions that keep the model's quality (docs/benchmarks.md has the accuracy runs)
AUTO_CANDIDATES = ("fp32", "int8", "int4")
_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "asimd",
              "sve")


def machine_id() -> str:
    """The CPU model, its relevant instruction sets and core count: what decides which precision runs fastest."""
    name, flags = platform.processor() or platform.machine(), set()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "model name":
                name = value.strip()
            elif key.strip() in ("flags", "Features"):
                flags = set(value.split())
    except OSError:
        pass
    return f"{name} [{' '.join(f for f in _CPU_FLAGS if f in flags)}] x{os.cpu_count()}"


# largest logit difference between a one-token step and a multi-token pass that still counts as the same
# computation: fp32 graphs differ only by summation order, int8-activation kernels by far more (docs/design.md)
ROW_TOLERANCE = 1e-3


def measure_graph(onnx_dir: Path, context: int = 150, rows: tuple[int, ...] = (1, 9), repeats: int = 6) -> dict:
    """Median milliseconds of a pass over each of ``rows`` new tokens at ``context`` cached tokens, and
    ``row_delta``: the largest logit difference between one-token steps and 4- and 9-token passes over the
    same tokens."""
    import numpy as np

    from fly_runtime.backends.ort_backend import OrtBackend

    backend = OrtBackend(onnx_dir, threads=os.cpu_count())
    prompt, tokens = [100 + i % 300 for i in range(context)], list(range(400, 409))  # ids every vocabulary has
    backend.forward(prompt, keep=1)
    out = {str(n): pass_seconds(backend.forward, backend.crop, context, tokens[:n], repeats - 1, warmup=1) * 1000
           for n in rows}
    single = np.concatenate([backend.forward([t]).numpy() for t in tokens])
    delta = 0.0
    for chunk in (4, 9):
        backend.crop(context)
        passes = np.concatenate([backend.forward(tokens[i:i + chunk]).numpy() for i in range(0, len(tokens), chunk)])
        delta = max(delta, float(np.abs(passes - single).max()))
    out["row_delta"] = delta
    return out


def pick(costs: dict[str, dict]) -> str:
    """The fastest one-token step among the precisions whose steps and passes agree (fp32 if none does)."""
    same = [p for p, c in costs.items() if c["row_delta"] <= ROW_TOLERANCE]
    return min(same, key=lambda p: (costs[p]["1"], costs[p]["9"])) if same else "fp32"


def _records_file() -> Path:
    return cache_dir() / "tuning.json"


def load_records() -> dict:
    try:
        return json.loads(_records_file().read_text())
    except (OSError, ValueError):
        return {}


def recorded_precision(model_key: str) -> dict | None:
    return load_records().get(f"{machine_id()}|{model_key}")


def choose_precision(model, candidates: tuple[str, ...] = AUTO_CANDIDATES) -> str:
    """The recorded choice for this machine and model, or (first time) measure each candidate and record."""
    record = recorded_precision(model.key)
    if record is not None and record.get("precision") in candidates:
        return record["precision"]
    print(f"fly: timing the target at {', '.join(candidates)} on this machine (once; kept in {_records_file()}) ...",
          file=sys.stderr, flush=True)
    costs = {p: measure_graph(model.build_onnx(p)) for p in candidates}
    choice = pick(costs)
    records = load_records()
    records[f"{machine_id()}|{model.key}"] = {"model": model.name, "precision": choice, "ms": costs,
                                              "date": time.strftime("%Y-%m-%d")}
    tmp = _records_file().with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=2))
    tmp.replace(_records_file())
    print(f"fly: target precision {choice} ({describe(costs)})", file=sys.stderr, flush=True)
    return choice


def describe(costs: dict[str, dict]) -> str:
    parts = []
    for p, c in costs.items():
        same = "" if c.get("row_delta", 0.0) <= ROW_TOLERANCE else f", rows differ by {c['row_delta']:.2f}"
        parts.append(f"{p} {c['1']:.0f} / {c['9']:.0f} ms{same}")
    return "one step / nine tokens: " + "; ".join(parts)

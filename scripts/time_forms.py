"""Time each form of a target on this machine, interleaved: a prompt read (milliseconds a token, in the engine's
128-token chunks), one-token steps and nine-token passes after it. Where routing's prices come from, measured at a
read length of your choosing (tuning times 64 tokens after 150).

    HF_HUB_OFFLINE=1 python scripts/time_forms.py --read 600 --repeats 3 [--graph path/to/another-graph-folder]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path


def main() -> None:
    from fly_runtime.backends.llama_cpp_backend import available
    from fly_runtime.backends.ort_backend import OrtBackend
    from fly_runtime.backends.registry import open_target
    from fly_runtime.engine import FlyEngine
    from fly_runtime.loader import DEFAULT_TARGET
    from fly_runtime.sources import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=DEFAULT_TARGET)
    parser.add_argument("--read", type=int, default=600, help="prompt tokens read before the steps")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--graph", action="append", default=[], type=Path, help="another graph folder to time")
    args = parser.parse_args()

    model = resolve_model(args.model)
    forms = {"int4": open_target(model, "int4")}
    if model.gguf is not None and available():
        forms["gguf"] = open_target(model, "gguf", context=args.read + 64)
    for folder in args.graph:
        forms["-".join(folder.name.split("-")[-2:])] = OrtBackend(folder)  # e.g. int8-g4
    ids = [100 + i % 300 for i in range(args.read)]  # ids every vocabulary has
    times: dict[str, dict[str, list[float]]] = {f: {"read ms/token": [], "step ms": [], "9-pass ms": []} for f in forms}
    for _ in range(args.repeats):
        for name, backend in forms.items():
            backend.crop(0)
            began = time.perf_counter()
            for at in range(0, len(ids), FlyEngine.PROMPT_CHUNK):  # as the engine reads a prompt
                backend.forward(ids[at:at + FlyEngine.PROMPT_CHUNK], keep=1)
            times[name]["read ms/token"].append((time.perf_counter() - began) * 1000 / len(ids))
            for rows, key, count in ((1, "step ms", 4), (9, "9-pass ms", 2)):
                for _ in range(count):
                    began = time.perf_counter()
                    backend.forward(list(range(600, 600 + rows)))
                    times[name][key].append((time.perf_counter() - began) * 1000)
    print(f"{'form':<10}" + "".join(f"{k:>16}" for k in next(iter(times.values()))))
    for name, row in times.items():
        print(f"{name:<10}" + "".join(f"{statistics.median(v):>16.2f}" for v in row.values()))


if __name__ == "__main__":
    main()

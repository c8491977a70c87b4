"""The target's form, and how many requests it decodes together, for this machine: chosen by measurement once
and kept in the cache.

``precision="auto"`` runs the fastest target that still is the model: the GGUF under llama.cpp, or an ONNX Runtime
graph already built. Which decodes fastest depends on the CPU (instruction set, cores, memory bandwidth), so each
candidate's one-token step and nine-token pass are timed once per machine and model; a graph qualifies only
where, teacher-forced over a fixed text, its next-token choice agrees with the model's full-precision weights at
least as often as ``AGREEMENT_FLOOR`` (llama.cpp on the same GGUF agrees about as often: docs/benchmarks.md). Token
identity between one-token steps and multi-token passes is measured and reported, not required: quantised kernels
round one row differently from several, as llama.cpp's and vLLM's do. The record lives in ``<cache>/tuning.json``;
``fly models list`` shows it and ``precision=...`` overrides it. Where the target's cache holds several sequences
(llama.cpp), ``choose_batch`` times one-token passes over 1-16 of them and keeps the smallest count near the best
throughput (``max_batch=...`` overrides it). The same passes price a drafter model: where it cannot pay beside the
target, ``draft="auto"`` fetches none (``drafts_can_pay``).
"""

from __future__ import annotations

import json
import os
import platform
import shutil
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from fly_runtime.sources.cache import cache_dir
from fly_runtime.sources.convert import GGUF
from fly_runtime.timing import median_seconds, pass_seconds

_CPU_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_tile", "amx_int8", "asimd",
              "asimddp", "sve")
# int8 products in hardware: there the int8 graph's multi-row passes can beat int4's, so both are timed
_INT8_DOT = {"avx512_vnni", "avx_vnni", "amx_int8", "asimddp"}
# a quantised graph must pick the full-precision model's next token this often (teacher-forced) to qualify
AGREEMENT_FLOOR = 0.97
# largest logit difference between a one-token step and a multi-token pass that counts as the same computation
ROW_TOLERANCE = 1e-3
REFERENCE_TOKENS = 1536
RECORD_VERSION = 7  # records of an older rule are measured again (7: each form's opening timed)
# the turn a form is judged by (docs/design.md, "Choosing the target's form"): an agent's tool turn or a RAG
# answer reads a few hundred tokens and writes about a hundred; drafts there (prompt lookup, the grammar's
# forced tokens) are free and survive about this often
TURN_READ, TURN_WRITE, TURN_SURVIVAL = 400, 100, 0.6
READ_TOKENS = 64  # the prompt-read pass timed per form
ROWS_COMPARED = 18  # tokens over which steps and 4- and 9-token passes are compared (reported, not required)
MEASURE_ROUNDS = 2
TIMED_CONTEXT = 2048  # room for the timed passes and a fidelity chunk
# cores other processes may keep busy while the forms are timed: beyond it the timings say more about them than about
# the forms (measured: a test run beside tuning doubled llama.cpp's step and left the int4 graph's reads alone, and
# the slower form was chosen), so the record is kept only until a process finds the machine quiet and times again
BUSY_CORES = 0.5


def _cpu() -> tuple[str, set[str]]:
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
    return name, flags


def machine_id() -> str:
    """The CPU model, its relevant instruction sets and core count: what decides which precision runs fastest."""
    name, flags = _cpu()
    return f"{name} [{' '.join(f for f in _CPU_FLAGS if f in flags)}] x{os.cpu_count()}"


def others_busy(seconds: float = 0.5) -> float:
    """Cores that other processes (and the hypervisor's steal) kept busy over the next ``seconds``: the machine's busy
    time from /proc/stat less this process's own; 0.0 where there is no /proc/stat."""
    def sample() -> tuple[float, float]:
        with open("/proc/stat") as f:
            ticks = [int(x) for x in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
        own = os.times()
        return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK"), own.user + own.system

    try:
        busy0, own0 = sample()
        time.sleep(seconds)
        busy1, own1 = sample()
    except (OSError, ValueError):
        return 0.0
    return max(0.0, (busy1 - busy0) - (own1 - own0)) / seconds


def timed_again(record: dict, busy_now) -> bool:
    """Whether a valid record is timed again now: it was timed while other processes kept the CPUs busy, and
    ``busy_now()`` (cores busy elsewhere now) finds the machine quiet."""
    return record.get("busy_cores", 0.0) >= BUSY_CORES and busy_now() < BUSY_CORES


def machine_candidates(model=None) -> tuple[str, ...]:
    """What to time here. A model that came as a GGUF, with llama-cpp-python installed: the GGUF under llama.cpp,
    its int4 graph where that is written straight from the GGUF (seconds, about the model's size on disk: a form
    that serves turns faster where rows are cheap), and whichever other graph is built already. Otherwise the int4
    graph, and int8 too where the CPU multiplies int8 in hardware, from the model's own weights (int8 of a GGUF
    model only if built already). fp32 is timed only where nothing else qualifies."""
    from fly_runtime.backends.llama_cpp_backend import available

    int8 = bool(_cpu()[1] & _INT8_DOT)
    if model is None or model.gguf is None:
        return ("int4", "int8") if int8 else ("int4",)
    direct = model.builds_from_gguf()
    graphs = tuple(p for p in ("int4", "int8") if model.has_graph(p) or (p == "int4" and direct))
    if available():
        return (GGUF, *graphs)
    return graphs or ("int4",)


def measure_graph(onnx_dir: Path, **kwargs) -> dict:
    """``measure`` on an ONNX Runtime graph folder."""
    from fly_runtime.backends.ort_backend import OrtBackend

    return measure(OrtBackend(onnx_dir, threads=os.cpu_count()), **kwargs)


def measure(backend, context: int = 150, rows: tuple[int, ...] = (1, 9, READ_TOKENS), repeats: int = 6,
            rows_alike: bool = True) -> dict:
    """Median milliseconds of a pass over each of ``rows`` new tokens at ``context`` cached tokens (the longest:
    a prompt read, timed fewer times), and (``rows_alike``) ``row_delta``: the largest logit difference between
    one-token steps and 4- and 9-token passes over the same ``ROWS_COMPARED`` tokens."""
    prompt = [100 + i % 300 for i in range(context)]  # ids every vocabulary has
    tokens = [400 + i % 300 for i in range(max(rows))]
    backend.crop(0)
    backend.forward(prompt, keep=1)
    out = {str(n): pass_seconds(backend.forward, backend.crop, context, tokens[:n],
                                repeats - 1 if n <= 16 else 2, warmup=1) * 1000 for n in rows}
    if not rows_alike:
        backend.crop(0)
        return out
    compared = tokens[:ROWS_COMPARED]
    single = np.concatenate([backend.forward([t]).numpy() for t in compared])
    delta = 0.0
    for chunk in (4, 9):
        backend.crop(context)
        passes = np.concatenate([backend.forward(compared[i:i + chunk]).numpy()
                                 for i in range(0, len(compared), chunk)])
        delta = max(delta, float(np.abs(passes - single).max()))
    backend.crop(0)
    out["row_delta"] = delta
    return out


# ------------------------------------------------------------------------------------------ fidelity
def reference_text_ids(tokenizer, count: int = REFERENCE_TOKENS) -> list[int]:
    """A fixed mix of code and English (fly's own sources, as shipped): what the agreement is measured on."""
    root = Path(__file__).parent
    text = "\n\n".join((root / name).read_text() for name in ("engine.py", "adaptive.py", "verify.py"))
    return tokenizer(text, add_special_tokens=False)["input_ids"][:count]


def _log_softmax(logits: np.ndarray) -> np.ndarray:
    shifted = logits - logits.max(axis=-1, keepdims=True)
    return shifted - np.log(np.exp(shifted).sum(axis=-1, keepdims=True))


def _chunked_logprobs(forward, ids: list[int], chunk: int = 128):
    """Log-probabilities of the next token after each of ``ids[:-1]``, a chunk of positions at a time."""
    for start in range(0, len(ids) - 1, chunk):
        yield _log_softmax(forward(ids[start:min(start + chunk, len(ids) - 1)]).numpy().astype(np.float64))


def teacher_forced(forward, ids: list[int], chunk: int = 128, top: int = 16) -> dict[str, np.ndarray]:
    """Each position's top-``top`` token ids and log-probabilities, feeding ``ids`` in chunks."""
    top_ids, top_lp = [], []
    for lp in _chunked_logprobs(forward, ids, chunk):
        order = np.argsort(-lp, axis=-1)[:, :top]
        top_ids.append(order.astype(np.int32))
        top_lp.append(np.take_along_axis(lp, order, axis=-1).astype(np.float32))
    return {"ids": np.asarray(ids, np.int32), "top_ids": np.concatenate(top_ids), "top_logprobs": np.concatenate(top_lp)}


# the built-in models' references ship with fly, so that fetching them never loads the fp32 model
SHIPPED_REFERENCES = Path(__file__).parent / "sources" / "references"


def reference(model, tokenizer) -> dict[str, np.ndarray]:
    """The full-precision model's teacher-forced choices (PyTorch, fp32 weights), computed once and cached."""
    name = f"{model.name}-{model.key}.npz"
    path = cache_dir() / "references" / name
    for known in (SHIPPED_REFERENCES / name, path):
        if known.is_file():
            return dict(np.load(known))
    from fly_runtime.backends.torch_backend import TorchBackend

    print(f"fly: computing {model.name}'s reference choices at full precision (once) ...", file=sys.stderr, flush=True)
    backend = TorchBackend(model.weights(), device="cpu")
    out = teacher_forced(lambda chunk: backend.forward(chunk), reference_text_ids(tokenizer))
    del backend
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(path.with_suffix(".tmp.npz"), **out)
    path.with_suffix(".tmp.npz").replace(path)
    return out


def fidelity(backend, ref: dict[str, np.ndarray]) -> dict[str, float]:
    """Top-1 agreement of a backend (or an ONNX graph folder) with the reference, and mean KL(reference ||
    backend) over the reference's top tokens."""
    if isinstance(backend, Path):
        from fly_runtime.backends.ort_backend import OrtBackend

        backend = OrtBackend(backend, threads=os.cpu_count())
    backend.crop(0)
    top_ids = ref["top_ids"].astype(np.int64)
    # per position: the backend's top token, and its log-probabilities of the reference's top tokens (a whole
    # vocabulary's log-probabilities for every position would take gigabytes)
    argmax, at_ref, done = [], [], 0
    for lp in _chunked_logprobs(backend.forward, ref["ids"].tolist()):
        argmax.append(lp.argmax(axis=-1))
        at_ref.append(np.take_along_axis(lp, top_ids[done:done + len(lp)], axis=-1))
        done += len(lp)
    agreement = float((np.concatenate(argmax) == top_ids[:, 0]).mean())
    p_ref = np.exp(ref["top_logprobs"].astype(np.float64))
    kl = (p_ref * (ref["top_logprobs"] - np.concatenate(at_ref))).sum(-1)
    backend.crop(0)
    return {"agreement": agreement, "kl": float(kl.mean())}


# ------------------------------------------------------------------------------------------ the choice
def pick(costs: dict[str, dict]) -> str:
    """The form that serves a typical turn fastest (``turn_seconds``) among those that qualify (agreement at
    least ``AGREEMENT_FLOOR``; a form measured without a fidelity qualifies, as fp32 does by being the
    reference, and the GGUF, and a graph on its own grid, by being the model as the user has it); fp32 if none
    does."""
    ok = [p for p, c in costs.items() if c.get("agreement", 1.0) >= AGREEMENT_FLOOR]
    return min(ok, key=lambda p: (turn_seconds(costs[p]), costs[p]["1"])) if ok else "fp32"


def held_forms(costs: dict[str, dict], choice: str) -> list[str]:
    """The forms held beside ``choice``: those that qualify (as ``pick`` says) and step or read prompts faster at
    all, so that some requests finish sooner there (the GGUF's faster steps for long free replies, a graph's faster
    reads and cheap verified rows for read-heavy turns that copy their prompt). A served engine opens them at load
    where memory allows, else once requests lost an opening's worth there (fly_runtime/loader.py); a margin had
    dropped llama.cpp on noisy timings (docs/design.md, "Each request on its form")."""
    mine = costs[choice]
    return [p for p, c in costs.items()
            if p not in (choice, "fp32") and c.get("agreement", 1.0) >= AGREEMENT_FLOOR
            and (c["1"] < mine["1"] or read_ms(c) < read_ms(mine))]


def read_ms(ms: dict) -> float:
    """Milliseconds a prompt token takes to read: the timed prompt read, else nine-token passes."""
    return ms[str(READ_TOKENS)] / READ_TOKENS if str(READ_TOKENS) in ms else ms["9"] / 9


def turn_seconds(ms: dict, reader_ms: float | None = None) -> float:
    """Seconds of a typical turn on a form with these pass times: reading TURN_READ prompt tokens (at ``reader_ms``
    a token where a prompt reader reads for the form), then writing TURN_WRITE at the speed-up free drafts reach there
    (none where a verified row costs about a step). A record without a timed prompt read prices it as nine-token
    passes."""
    prices = pass_prices(ms)
    read = read_ms(ms) if reader_ms is None else reader_ms
    speedup = max(1.0, prices.best_speedup(TURN_SURVIVAL, by_model=False))
    return (TURN_READ * read / 1000) + TURN_WRITE * prices.step / speedup


def _records_file() -> Path:
    return cache_dir() / "tuning.json"


def load_records() -> dict:
    try:
        return json.loads(_records_file().read_text())
    except (OSError, ValueError):
        return {}


def _record(key: str, record: dict, dated: bool = True) -> None:
    """Keep ``record`` (of this rule's version, dated unless ``dated`` is False) under ``key`` in tuning.json,
    replacing the file whole (from a scratch file of this process's own, so that two writers never mix)."""
    records = load_records()
    records[key] = record | {"version": RECORD_VERSION} | ({"date": time.strftime("%Y-%m-%d")} if dated else {})
    tmp = _records_file().with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(records, indent=2))
    tmp.replace(_records_file())


def recorded_precision(model_key: str) -> dict | None:
    return load_records().get(f"{machine_id()}|{model_key}")


def choose_precision(model, tokenizer=None, candidates: tuple[str, ...] | None = None) -> str:
    """The recorded choice for this machine and model, or (first time, or where the candidates changed: a graph
    built since, llama-cpp-python installed since) time and check each candidate and record the result."""
    candidates = candidates or machine_candidates(model)
    record = recorded_precision(model.key)
    if (record is not None and record.get("version") == RECORD_VERSION
            and sorted(record.get("candidates", ())) == sorted(candidates)):
        if not timed_again(record, others_busy):
            return record["precision"]
        print("fly: the target's forms were timed while other processes kept the CPUs busy; timing them again now "
              "that the machine is quiet", file=sys.stderr, flush=True)
    from fly_runtime.backends.registry import load_tokenizer, open_target

    print(f"fly: choosing the target's form among {', '.join(candidates)} on this machine (once; kept in "
          f"{_records_file()}) ...", file=sys.stderr, flush=True)
    busy = others_busy()
    if busy >= BUSY_CORES:
        print(f"fly: other processes are using {busy:.1f} of {os.cpu_count()} CPUs: the forms are timed now and again "
              "by a later process once the machine is quiet", file=sys.stderr, flush=True)
    if model.gguf is not None and GGUF not in candidates:
        _say_llama_cpp_missing()
    graphs = [p for p in candidates if p != GGUF]  # the GGUF is the model as the user has it: nothing to check
    built_now = [p for p in graphs if not model.has_graph(p)]  # written for this comparison (GGUF ones only)
    for p in built_now:
        model.build_onnx(p)
    # a graph on the GGUF's own grid is the file's model as llama.cpp runs it: nothing to check either
    checked = [p for p in graphs if not model.on_own_grid(p)]
    ref = reference(model, tokenizer or load_tokenizer(model)) if checked else None
    costs: dict[str, dict] = {p: {} for p in candidates}
    # timed in turns, so that the machine's drift (a VM's neighbours, clocks) hits every candidate alike; one form
    # open at a time, so that choosing costs no more memory than running (the fidelity and the row differences,
    # which do not drift, in the first turn only)
    rounds: list[dict[str, dict]] = []
    for turn in range(MEASURE_ROUNDS if len(candidates) > 1 else 1):
        rounds.append({})
        for p in candidates:
            began = time.perf_counter()
            backend = open_target(model, p, context=TIMED_CONTEXT)  # llama.cpp's cache for what is timed only
            opened = (time.perf_counter() - began) * 1000
            if turn == 0 and p in checked:
                costs[p].update(fidelity(backend, ref))
            # "open": what opening it took (the router's price for opening a form held beside the first)
            rounds[-1][p] = {**measure(backend, repeats=4, rows_alike=turn == 0), "open": opened}
            getattr(backend, "close", lambda: None)()
            del backend
    for p in costs:
        costs[p].update({key: statistics.median(r[p][key] for r in rounds if key in r[p]) for key in rounds[0][p]})
    choice = pick(costs)
    held = held_forms(costs, choice)
    for p in built_now:  # a graph written only to be timed, and neither chosen nor held, is not kept
        if p != choice and p not in held:
            shutil.rmtree(model.graph_folder(p), ignore_errors=True)
    if choice not in costs:  # nothing quantised qualified: the full-precision graph, timed for the record
        costs[choice] = measure(open_target(model, choice))
    _record(f"{machine_id()}|{model.key}", {"model": model.name, "precision": choice, "ms": costs,
                                             "candidates": list(candidates), "held": held,
                                             **({"busy_cores": round(busy, 2)} if busy >= BUSY_CORES else {})})
    also = f"; {', '.join(held)} held beside it, each request served on the form that finishes it soonest" if held else ""
    print(f"fly: target {choice}{also} ({describe(costs)})", file=sys.stderr, flush=True)
    return choice


def recorded_forms(model) -> tuple[dict[str, dict], list[str]]:
    """The pass times of each form timed for ``model`` on this machine, and the forms held beside the chosen one
    (tuning's record; none where there is no record of this rule)."""
    record = recorded_precision(model.key)
    if record is None or record.get("version") != RECORD_VERSION:
        return {}, []
    return record["ms"], list(record.get("held", ()))


def _prices_kept() -> bool:
    """Whether routing starts from and keeps what earlier processes learned here; ``FLY_KEEP_PRICES=0`` makes each
    process learn anew, leaving the record as it is (the test suite's short replies would otherwise teach the
    user's later processes; a benchmark run may want to start from tuning's timings alone)."""
    return os.environ.get("FLY_KEEP_PRICES", "1") != "0"


def recorded_prices(model) -> dict:
    """What routing learned from the requests served here (``Router.learned``; empty where nothing was kept)."""
    if not _prices_kept():
        return {}
    record = recorded_precision(model.key)
    return record.get("learned", {}) if record is not None and record.get("version") == RECORD_VERSION else {}


def keep_prices(model, learned: dict) -> None:
    """Keep ``learned`` (``Router.learned``) with this machine's record for ``model``; nothing where there is no
    record of this rule (one measured anew will be learned anew), nor with ``FLY_KEEP_PRICES=0``."""
    if not _prices_kept():
        return
    key = f"{machine_id()}|{model.key}"
    record = load_records().get(key)
    if record is not None and record.get("version") == RECORD_VERSION and record.get("learned") != learned:
        _record(key, record | {"learned": learned}, dated=False)  # the date is the measurement's


def _say_llama_cpp_missing() -> None:
    print("fly: llama-cpp-python is not installed, so this GGUF runs only as an ONNX Runtime graph written from it "
          "(its one-token steps are slower than llama.cpp's on most CPUs); `pip install llama-cpp-python==0.3.36` adds "
          "llama.cpp (it compiles once, 10-25 minutes)", file=sys.stderr, flush=True)


def pass_costs(open_backend, model, precision: str) -> dict:
    """Milliseconds of the target's one-token step ("1") and nine-token pass ("9") at ``precision`` on this
    machine: from the precision record where it timed this form, else measured once on ``open_backend()`` and
    recorded."""
    records = load_records()
    for key in (f"{machine_id()}|{model.key}", f"{machine_id()}|{model.key}|{precision}|passes"):
        record = records.get(key)
        if record is not None and record.get("version") == RECORD_VERSION and precision in record.get("ms", {}):
            return record["ms"][precision]
    ms = measure(open_backend(), repeats=4)
    _record(f"{machine_id()}|{model.key}|{precision}|passes", {"model": model.name, "precision": precision,
                                                                "ms": {precision: ms}})
    return ms


def pass_prices(ms: dict, draft_share: float = 0.0):
    """``pass_costs``' milliseconds as the adaptive policy's prices: a step, what each token past the first of a
    pass adds (a verified row), and a drafter token at ``draft_share`` of a step."""
    from fly_runtime.adaptive import CostProfile

    step = ms["1"] / 1000
    return CostProfile(step=step, row=max(0.0, ms["9"] / 1000 - step) / 8, draft=draft_share * step)


# bytes a weight of each form of the target reads, over its Q4_K_M GGUF's (about 4.85 bits a weight); the drafter
# runs as an int4 graph, about its GGUF's size
_FORM_BYTES = {GGUF: 1.0, "int4": 1.0, "int8": 9 / 4.85, "fp32": 32 / 4.85}


def drafter_share(target: str, drafter: str, precision: str = GGUF) -> float:
    """A drafter's step as a share of the target's at ``precision``, before either is measured: the bytes of
    weights each step reads (a CPU step reads every weight once), where fly knows both files' sizes; 0 (free)
    where it does not."""
    from fly_runtime.sources import BUILTIN_MODELS

    if target in BUILTIN_MODELS and drafter in BUILTIN_MODELS:
        return BUILTIN_MODELS[drafter].size / (BUILTIN_MODELS[target].size * _FORM_BYTES.get(precision, 1.0))
    return 0.0


def drafts_can_pay(ms: dict, draft_share: float = 0.0) -> bool:
    """Could a drafter model pay beside a target with these pass times, its steps priced at ``draft_share`` of the
    target's, at a survival most drafters never reach (CostProfile.model_drafts_pay)? Where it cannot, none is
    fetched."""
    return pass_prices(ms, draft_share).model_drafts_pay()


def forms_in_use() -> dict[str, str]:
    """The graph folders (by name) that what runs here reads, with why: each target's recorded choice on this
    machine where it is a graph, and a built-in pair's int4 drafter where drafts can pay beside its target."""
    from fly_runtime.sources import BUILTIN_MODELS, BUILTIN_PAIRS
    from fly_runtime.sources.convert import graph_folder_name as folder

    drafters = dict(BUILTIN_PAIRS.values())
    used: dict[str, str] = {}
    for key, record in load_records().items():
        parts = key.split("|")
        if parts[0] != machine_id() or len(parts) != 2 or record.get("version") != RECORD_VERSION:
            continue
        if parts[1] == BF16_PRODUCT:  # the machine's own record, not a model's choice
            continue
        precision = record["precision"]
        if precision != GGUF:
            used[folder(record["model"], parts[1], precision)] = f"the target here (precision auto chose {precision})"
        for held in record.get("held", ()):
            if held != GGUF:
                used[folder(record["model"], parts[1], held)] = (f"the target here for the requests it serves sooner "
                                                                 f"(held beside {precision})")
        draft = drafters.get(record["model"])
        share = drafter_share(record["model"], draft, precision)
        if draft in BUILTIN_MODELS and drafts_can_pay(record["ms"][precision], share):
            used[folder(draft, BUILTIN_MODELS[draft].sha256[:16], "int4")] = f"the drafter of {record['model']} here"
    return used


BF16_PRODUCT = "bf16-product"  # the record of this machine's timed bfloat16 product: a machine's, naming no model


def bf16_product_ms() -> float:
    """The bfloat16 matrix product a prompt reader's price is predicted from (backends/bf16_reader.py), timed once
    per machine and recorded."""
    key = f"{machine_id()}|{BF16_PRODUCT}"
    record = load_records().get(key)
    if record is not None and record.get("version") == RECORD_VERSION:
        return float(record["ms"])
    from fly_runtime.backends.bf16_reader import product_ms

    ms = product_ms()
    _record(key, {"ms": round(ms, 2)})
    return ms


# ------------------------------------------------------------------------------------------ batch size
BATCH_CANDIDATES = (1, 2, 4, 8, 16)  # requests decoded together; the largest is what a target is opened with
BATCH_NEAR_BEST = 0.95  # the smallest batch within this share of the best throughput: latency for nothing else


def choose_batch(backend, model, context: int = 64, repeats: int = 5) -> int:
    """How many requests the target decodes together on this machine: the recorded choice, or (first time, or
    where the record timed other counts) the smallest of ``BATCH_CANDIDATES`` whose one-token passes over that
    many sequences make at least ``BATCH_NEAR_BEST`` of the best tokens a second, recorded."""
    key = f"{machine_id()}|{model.key}|batch"
    record = load_records().get(key)
    sizes = [n for n in BATCH_CANDIDATES if n <= backend.sequences]
    if (record is not None and record.get("version") == RECORD_VERSION
            and sorted(record.get("ms", {}), key=int) == [str(n) for n in sizes]):
        return record["max_batch"]
    backend.crop_sequence(0, 0)
    backend.forward_rows([(0, [100 + i % 300 for i in range(context)], 1)])
    for seq in range(1, sizes[-1]):
        backend.share(0, seq, context)

    def step(n: int) -> None:  # one token on each of n sequences, then back to where they were
        backend.forward_rows([(seq, [400], 1) for seq in range(n)])
        for seq in range(n):
            backend.crop_sequence(seq, context)

    ms = {n: median_seconds(lambda: step(n), repeats, warmup=1) * 1000 for n in sizes}
    for seq in range(sizes[-1]):
        backend.crop_sequence(seq, 0)
    rate = {n: n / ms[n] for n in sizes}
    choice = min(n for n in sizes if rate[n] >= BATCH_NEAR_BEST * max(rate.values()))
    _record(key, {"model": model.name, "max_batch": choice, "ms": {str(n): round(ms[n], 1) for n in sizes}})
    return choice


def recorded_batch(model) -> int | None:
    """The batch ``choose_batch`` recorded for ``model`` on this machine, if it ran (on llama.cpp)."""
    record = load_records().get(f"{machine_id()}|{model.key}|batch")
    return record["max_batch"] if record is not None and record.get("version") == RECORD_VERSION else None


def describe(costs: dict[str, dict]) -> str:
    parts = []
    for p, c in costs.items():
        text = f"{p} {c['1']:.0f} / {c['9']:.0f} ms"
        if str(READ_TOKENS) in c:
            text += f" / {c[str(READ_TOKENS)]:.0f} ms, a typical turn {turn_seconds(c):.1f} s"
        if "agreement" in c:
            text += f", agrees {100 * c['agreement']:.1f}%"
            if c["agreement"] < AGREEMENT_FLOOR:
                text += f" (< {100 * AGREEMENT_FLOOR:.0f}%: not the model)"
        if c.get("row_delta", 0.0) > ROW_TOLERANCE:
            text += f", steps and passes differ by {c['row_delta']:.2f}"
        parts.append(text)
    return f"one step / nine tokens / {READ_TOKENS} read: " + "; ".join(parts)

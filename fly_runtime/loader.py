"""Build an engine from model references, once per process for each distinct set of model settings."""

from __future__ import annotations

import atexit
import os
import threading
import weakref
from dataclasses import dataclass
from typing import Literal

from fly_runtime.backends.base import Backend, CachedSequence
from fly_runtime.backends.registry import GGUF, load_tokenizer, open_backend, open_target  # noqa: F401 (public here too)
from fly_runtime.drafters import Drafter, ModelDrafter, NgramDrafter, QuotedLookup, ReplyHistory
from fly_runtime.engine import FlyEngine, TargetForm
from fly_runtime.errors import FlyError, IncompatibleModelsError, InvalidSettingsError
from fly_runtime.sources import BUILTIN_PAIRS, DEFAULT_PAIR, ResolvedModel, resolve_model
from fly_runtime.tuning import BATCH_CANDIDATES, choose_batch

BackendName = Literal["auto", "torch", "onnx"]
DEFAULT_TARGET, DEFAULT_DRAFT = BUILTIN_PAIRS[DEFAULT_PAIR]
AUTO_DRAFT = "auto"


@dataclass(frozen=True)
class ModelSettings:
    """What identifies a loaded pair. Two callers with equal settings share one engine."""

    target: str = DEFAULT_TARGET
    # "auto": the built-in pair's drafter for a built-in target, else the default drafter where it shares the
    # target's tokenizer, else none; None: prompt-lookup n-grams only
    draft: str | None = AUTO_DRAFT
    backend: BackendName = "auto"
    device: str | None = None
    # the target on the CPU: an ONNX Runtime graph (fp32, int8, int4), the GGUF run by llama.cpp (gguf), or auto:
    # the fastest of them on this machine for a typical turn that keeps the model's choices (fly_runtime/tuning.py),
    # with any other form that steps or reads faster held beside it, each request served on the form that finishes
    # it soonest (fly_runtime/routing.py; the held forms open beside the requests at load where memory allows, else
    # once they pay); drafter: int4
    precision: str = "auto"
    # requests the target decodes together, each on a sequence of its cache (where the backend holds several:
    # llama.cpp); the rest wait their turn. None: as many as pay on this machine (measured once, tuning.py)
    max_batch: int | None = None

    def __post_init__(self) -> None:
        if self.max_batch is not None and (not isinstance(self.max_batch, int) or not 1 <= self.max_batch <= 64):
            raise InvalidSettingsError(f"max_batch must be an integer from 1 to 64 (or None: measured), got "
                                       f"{self.max_batch!r}")


# the most cells llama.cpp's cache grows to where it is held beside a graph, so that the second form's cache stays
# small: longer requests go to the graph
ROUTED_CONTEXT = 8192

_engines: dict[ModelSettings, FlyEngine] = {}
_engines_lock = threading.Lock()
# the routers of engines holding several forms, and their models: what each learned is kept with tuning's record
# when its engine is dropped and when the process ends, so that the next process here starts from it
_routers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _keep_prices() -> None:
    from fly_runtime.tuning import keep_prices

    for router, model in list(_routers.items()):
        try:
            keep_prices(model, router.learned())
        except OSError:  # a read-only or vanished cache: the next process learns anew
            pass


atexit.register(_keep_prices)


def get_engine(settings: ModelSettings, tokenizer=None) -> FlyEngine:
    """The shared engine for ``settings``, loading it on first use (with ``tokenizer``, the target's, where the
    caller loaded it already and hands it over)."""
    with _engines_lock:
        engine = _engines.get(settings)
        if engine is None:
            engine = _engines[settings] = load_engine(settings, tokenizer)
        return engine


def loaded(settings: ModelSettings) -> FlyEngine | None:
    """The engine for ``settings`` where one is loaded; None, loading nothing, where none is."""
    with _engines_lock:
        return _engines.get(settings)


def unload(settings: ModelSettings | None = None, keep: ModelSettings | None = None) -> None:
    """Forget the engine for ``settings`` (where None: every engine but ``keep``'s): its memory is freed once no
    caller holds it, and a later ``get_engine`` loads it again. llama.cpp's objects hold each other in cycles, so
    the garbage collector runs here rather than at its own next pass."""
    import gc

    _keep_prices()
    with _engines_lock:
        dropped = [_engines.pop(s) for s in ([s for s in _engines if s != keep] if settings is None else [settings])
                   if s in _engines]
    while dropped:
        dropped.pop().settle()  # a form still opening would be kept alive by its thread
    gc.collect()
    _return_freed_heap()


def _return_freed_heap() -> None:
    """Hand the heap pages the dropped engines freed back to the system: glibc keeps them for the process's later
    allocations, 1.0 of a default engine's 3.1 GB measured (nothing where the C library is another)."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _pick_backend(settings: ModelSettings) -> str:
    if settings.backend not in ("auto", "torch", "onnx"):
        raise InvalidSettingsError(f"backend must be auto, torch or onnx, got {settings.backend!r}")
    if settings.backend != "auto":
        return settings.backend
    import torch

    on_gpu = (settings.device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda")
    return "torch" if on_gpu else "onnx"


def target_precision(settings: ModelSettings, model: ResolvedModel, tokenizer=None) -> str:
    """The target graph's precision: as set, or for ``auto`` the fastest on this machine that is still the model
    (fly_runtime/tuning.py)."""
    from fly_runtime.sources.convert import TARGET_PRECISIONS

    if model.exported_onnx:
        return "as exported"
    if settings.precision == "auto":
        from fly_runtime.tuning import choose_precision

        return choose_precision(model, tokenizer)
    if settings.precision not in TARGET_PRECISIONS:
        raise InvalidSettingsError(
            f"precision must be auto or one of {', '.join(TARGET_PRECISIONS)}, got {settings.precision!r}")
    return settings.precision


def check_same_tokenizer(target_tok, draft_tok, target_name: str, draft_name: str) -> None:
    if target_tok.get_vocab() != draft_tok.get_vocab():
        raise IncompatibleModelsError(
            f"drafter {draft_name!r} and target {target_name!r} have different vocabularies "
            f"({len(draft_tok)} vs {len(target_tok)} tokens): speculative decoding needs one tokenizer. "
            "Pick a drafter from the target's model family."
        )


def eos_ids(model: ResolvedModel, tokenizer) -> set[int]:
    from transformers import GenerationConfig

    ids: set[int] = set()
    try:
        eos = GenerationConfig.from_pretrained(model.hf_dir).eos_token_id
    except OSError:
        eos = None
    for value in (eos, tokenizer.eos_token_id):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def load_engine(settings: ModelSettings, tokenizer=None) -> FlyEngine:
    kind = _pick_backend(settings)
    target_model = resolve_model(settings.target)
    tokenizer = tokenizer or load_tokenizer(target_model)
    vocab_size = len(tokenizer)
    precision = target_precision(settings, target_model, tokenizer) if kind == "onnx" else "fp32"
    readers = _prompt_readers(target_model) if kind == "onnx" else {}
    reader = readers.get(GGUF)
    chosen = precision
    if reader is not None and reader.promising():
        # the form that serves a typical turn soonest, its read at the reader's price where the reader is expected to
        # read for it, serves first; the other is held beside it (opened once it pays)
        ms, held = _held_names(settings, kind, target_model, precision)
        if ms:
            precision = first_form({p: ms[p] for p in (precision, *held)}, readers)
    target_backend = open_backend(target_model, kind, precision, device=settings.device,
                                  sequences=settings.max_batch or max(BATCH_CANDIDATES))
    if precision in readers:
        target_backend.reader = readers[precision]  # type: ignore[attr-defined]
    draft_name = settings.draft
    if draft_name == AUTO_DRAFT:
        draft_name = auto_drafter(settings.target, tokenizer)
        if draft_name is not None and not _drafts_can_pay(kind, target_backend, target_model, precision, draft_name):
            draft_name = None
    drafter: Drafter
    lookup: NgramDrafter | None = None
    history = ReplyHistory()  # the replies this engine writes, which prompt lookup also draws on (suffix drafts)
    quoted = QuotedLookup(tokenizer)  # a quoted value's first tokens, looked up by text where ids do not match
    if draft_name is None:
        drafter = NgramDrafter(history=history, quoted=quoted)
    else:
        draft_model = resolve_model(draft_name)
        check_same_tokenizer(tokenizer, load_tokenizer(draft_model), settings.target, draft_name)
        draft_sequence = CachedSequence(open_backend(draft_model, kind, "int4", device=settings.device))
        # prompt lookup (stateless) serves twice: in front of the drafter where a request asks for n-grams, and
        # alone before the drafter reads
        lookup = NgramDrafter(history=history, quoted=quoted)
        drafter = ModelDrafter(draft_sequence, vocab_size, lookup)
    max_batch = settings.max_batch
    if max_batch is None and getattr(target_backend, "sequences", 1) > 1:
        max_batch = choose_batch(target_backend, target_model)
    alternates, router = _held_forms(settings, kind, target_model, precision, target_backend.max_context, readers,
                                     chosen)
    engine = FlyEngine(
        CachedSequence(target_backend),
        tokenizer,
        drafter,
        vocab_size=vocab_size,
        eos_token_ids=eos_ids(target_model, tokenizer),
        max_context=target_backend.max_context,
        lookup=lookup,
        host_threads=1 if kind == "onnx" else None,
        draft_name=draft_name,
        max_batch=max_batch,
        history=history,
        form=precision,
        alternates=alternates,
        router=router,
    )
    if draft_name is None and kind == "onnx":
        _price_forms_from_tuning(engine, target_model)
    held = [f.name for f in alternates]
    if held and _room_for(target_model, held):
        engine.open_beside(held)  # a served engine holds every form that wins here; no request waits for them
    return engine


# memory a served engine leaves the rest of the machine once its held forms are open; with less free, a held form
# opens only once the requests it suits have lost what opening it costs (fly_runtime/routing.py)
OPEN_RESERVE = 2 << 30


def _room_for(model: ResolvedModel, forms: list[str]) -> bool:
    """Whether the memory free now holds ``forms`` (about their files' sizes: llama.cpp's repacked weights and ONNX
    Runtime's initializers take as much) and still leaves ``OPEN_RESERVE``."""
    import psutil

    def size(form: str) -> int:
        if form == GGUF:
            return model.gguf.stat().st_size if model.gguf is not None else 0
        return sum(f.stat().st_size for f in model.graph_folder(form).rglob("*") if f.is_file())

    return psutil.virtual_memory().available >= sum(map(size, forms)) + OPEN_RESERVE


def _price_forms_from_tuning(engine: FlyEngine, model: ResolvedModel) -> None:
    """Where prompt lookup drafts alone (a draft costs nothing), each form's prices are the pass times tuning
    recorded here, so the first request (all a `fly generate` makes) does not time them again; a form tuning did
    not time is timed on its first request."""
    from fly_runtime.tuning import pass_prices, recorded_forms

    ms, _ = recorded_forms(model)
    for form in engine.forms:
        if form.name in ms and {"1", "9"} <= set(ms[form.name]):
            form.learned.costs = pass_prices(ms[form.name])


def first_form(ms: dict[str, dict], readers: dict) -> str:
    """Of the forms timed as ``ms`` (tuning's pass times), the one a typical turn finishes on soonest, its read priced
    at the prompt reader's where its slot in ``readers`` expects the reader to read there (as the router prices it:
    ``Router._read_price``), else at the form's own."""
    from fly_runtime.tuning import turn_seconds

    def read_ms(form: str) -> float | None:
        slot = readers.get(form)
        return slot.reader_ms if slot is not None and slot.expected() else None

    turns = {p: turn_seconds(ms[p], read_ms(p)) for p in ms}
    return min(turns, key=turns.__getitem__)


def _held_names(settings: ModelSettings, kind: str, model: ResolvedModel, precision: str,
                chosen: str | None = None) -> tuple[dict, list[str]]:
    """Tuning's pass times of each form, and the forms held beside ``precision`` that can run here (none where the
    precision is set); ``chosen``: tuning's choice where ``precision`` replaced it (held beside it then)."""
    if settings.precision != "auto" or kind != "onnx" or model.exported_onnx:
        return {}, []
    from fly_runtime.backends.llama_cpp_backend import available
    from fly_runtime.sources.convert import GGUF
    from fly_runtime.tuning import recorded_forms

    ms, held = recorded_forms(model)
    if chosen is not None and chosen != precision:  # the prompt reader put another form first: tuning's choice is held
        held = [chosen, *held]
    gguf_runs = available() and model.gguf is not None
    held = [p for p in held if p != precision and (gguf_runs if p == GGUF else model.has_graph(p))]
    return (ms, held) if precision in ms else ({}, [])


def _held_forms(settings: ModelSettings, kind: str, model: ResolvedModel, precision: str, max_context: int,
                readers: dict | None = None, chosen: str | None = None):
    """The other forms of the target ``precision="auto"`` holds on this machine (tuning's record), each opened on
    its first request, and the router that sends each request to the form predicted to finish it soonest; none
    where the precision is set, or no other form steps or reads faster here."""
    from fly_runtime.routing import Router
    from fly_runtime.sources.convert import GGUF
    from fly_runtime.tuning import recorded_batch, recorded_prices

    ms, held = _held_names(settings, kind, model, precision, chosen)
    if not held:
        return [], None
    alternates = []
    for p in held:
        # llama.cpp decodes several requests together where tuning found that it pays (the batch it recorded)
        context, batch = (min(ROUTED_CONTEXT, max_context), settings.max_batch or recorded_batch(model) or 1) \
            if p == GGUF else (max_context, 1)

        def opener(p: str = p, context: int = context, batch: int = batch) -> CachedSequence:
            backend = open_target(model, p, sequences=batch, context=context if p == GGUF else 0)
            if p in (readers or {}):
                backend.reader = readers[p]  # type: ignore[attr-defined]
            return CachedSequence(backend)

        alternates.append(TargetForm(p, context, opener=opener, max_batch=batch))
    router = Router.timed(ms, [precision, *held], recorded_prices(model))
    router.readers = {p: slot for p, slot in (readers or {}).items() if p in (precision, *held)}
    _routers[router] = model
    return alternates, router


# the forms a prompt reader reads for: llama.cpp's cache and the quantised graphs written from the same GGUF (judged,
# like the reader, by their agreement with the model's weights); never the float32 graph, asked for by its precision
READ_FORMS = (GGUF, "int4", "int8")


def _prompt_readers(model: ResolvedModel) -> dict:
    """The prompt reader's slots for the model's forms (fly_runtime/backends/bf16_reader.py), one reader shared: long
    prompt reads in bfloat16 where this CPU makes them at least ``ReaderSlot.GAIN`` times faster than the form's own,
    opened once that has paid for its opening; none where the model came as no GGUF, the reader does not compute it,
    or ``FLY_PROMPT_READER=0`` leaves every read to the forms. By default it widens the GGUF's own blocks each read
    (``gguf``; int8 rows where that does not build); ``int8`` keeps int8 rows, ``bf16`` bfloat16 weights (2 bytes a
    weight; no widening: reads of a few hundred tokens faster)."""
    from fly_runtime.backends.bf16_reader import WEIGHTS, ReaderSlot

    setting = os.environ.get("FLY_PROMPT_READER", "1").strip().lower()
    kept_as = WEIGHTS[0] if setting == "1" else setting  # 1: on, as the reader keeps its weights by default
    if setting != "0" and kept_as not in WEIGHTS:
        raise InvalidSettingsError(f"FLY_PROMPT_READER={setting!r} is not a prompt reader setting: use 0 (off), 1 or "
                                   "gguf (on, widening the GGUF's own blocks), int8 (on, its weights as int8 rows), or "
                                   "bf16 (on, its weights in bfloat16)")
    if model.gguf is None or setting == "0":
        return {}
    from fly_runtime.sources.cache import cache_dir
    from fly_runtime.tuning import bf16_product_ms, read_ms, recorded_forms

    slot = ReaderSlot.for_model(model.gguf, bf16_product_ms(), cache_dir() / "reader", kept_as)
    if slot is None:
        return {}
    ms, _ = recorded_forms(model)  # each form's reads as tuning timed them, until its own are seen
    slot.own_ms = read_ms(ms[GGUF]) if GGUF in ms else None
    return {GGUF: slot, **{p: slot.for_form(read_ms(ms[p]) if p in ms else None) for p in READ_FORMS[1:]}}


def form_for_one_request(settings: ModelSettings, prompt_tokens: int, config) -> str | None:
    """The form that would serve a single request of ``prompt_tokens`` soonest, where ``precision="auto"`` holds
    several (tuning's record, made here first if needed) and the request is not seeded; else None. A one-shot
    process (``fly generate``) opens that form alone: the router would never open a second form for one request,
    and the form tuning chose first is the one for a typical turn (a few hundred tokens read, a hundred written),
    not for a long free reply to a short prompt, which llama.cpp writes 1.5x faster on this machine kind."""
    if settings.precision != "auto" or config.seed is not None or _pick_backend(settings) != "onnx":
        return None
    from fly_runtime.routing import Router, request_kind
    from fly_runtime.tuning import recorded_prices

    model = resolve_model(settings.target)
    chosen = target_precision(settings, model)
    ms, held = _held_names(settings, "onnx", model, chosen)
    if not held:
        return None
    forms = [chosen, *held]
    router = Router.timed(ms, forms, recorded_prices(model))
    kind = request_kind(config, prompt_tokens)
    return min(forms, key=lambda p: router.predict(p, kind, prompt_tokens, config.max_new_tokens))


def _drafts_can_pay(kind: str, backend: Backend, model: ResolvedModel, precision: str, drafter: str) -> bool:
    """Could ``drafter`` pay beside this target on this machine? On the CPU that is a question of the target's
    measured prices and the drafter's size beside it (tuning.drafts_can_pay); where it cannot, ``draft="auto"``
    fetches and loads none and drafts by prompt lookup, and a drafter named outright still loads."""
    if kind != "onnx":
        return True  # a GPU verifies a row for almost nothing
    from fly_runtime.tuning import drafter_share, drafts_can_pay, pass_costs

    return drafts_can_pay(pass_costs(lambda: backend, model, precision), drafter_share(model.name, drafter, precision))


def auto_drafter(target: str, tokenizer) -> str | None:
    """The drafter fly knows for ``target``: its built-in pair's; else the default drafter where it reads the
    target's tokenizer (a Qwen2.5 model from the Hub, say); else None (prompt lookup alone)."""
    for pair_target, pair_draft in BUILTIN_PAIRS.values():
        if pair_target == target:
            return pair_draft
    if target == DEFAULT_DRAFT:
        return None  # the drafter as a target has no smaller sibling here
    try:
        same = load_tokenizer(resolve_model(DEFAULT_DRAFT)).get_vocab() == tokenizer.get_vocab()
    except FlyError:  # the default drafter cannot be fetched here: draft by prompt lookup
        return None
    return DEFAULT_DRAFT if same else None

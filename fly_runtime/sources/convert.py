"""One-time conversions into the cache: GGUF -> Hugging Face directory, Hugging Face -> ONNX (fp32 / int4)."""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from fly_runtime.errors import ModelIntegrityError
from fly_runtime.sources.cache import atomic_directory


# bump a precision's version when its graphs change, so caches rebuild them (2: fused GQA + logits_to_keep; 3: int4
# of a GGUF on its own grid; 4: int4 and int8 written from the GGUF a tensor at a time)
GRAPH_VERSIONS = {"fp32": 3, "int8": 4, "int4": 4}


def _say(message: str) -> None:
    print(f"fly: {message}", file=sys.stderr, flush=True)


def graph_folder_name(model_name: str, key: str, precision: str) -> str:
    """The cache folder of a model's graph at ``precision`` (``inventory._GRAPH`` reads the name back)."""
    return f"{model_name}-{key}-{precision}-g{GRAPH_VERSIONS[precision]}"


def onnx_model_file(onnx_dir: Path) -> Path:
    """The graph inside a built folder (its weights sit beside it in ``model.onnx.data``)."""
    return onnx_dir / "model.onnx"


def gguf_to_hf(gguf_file: Path, out_dir: Path, weights: bool = True) -> Path:
    """A Hugging Face directory for a GGUF: config, generation config, tokenizer and chat template, read from the
    GGUF's metadata alone (seconds, no tensor touched); with ``weights``, also its tensors dequantised to float32.

    llama.cpp runs the GGUF itself and needs only the tokenizer here, so the float32 copy (4 bytes a parameter,
    peak memory several times the model) is written only for what reads it: the torch backend, a graph build
    from Hugging Face weights, the full-precision reference of a model fly ships none for.
    """
    if (out_dir / "config.json").is_file() and (not weights or has_weights(out_dir)):
        return out_dir
    if not weights:
        return _gguf_metadata_to_hf(gguf_file, out_dir)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf_file.name} to float32 Hugging Face weights (once; cached in {out_dir}) ...")
    start = time.perf_counter()
    try:
        with _plain_gguf_parsing():
            # a folder whose weights were dropped keeps its tokenizer: building one from the GGUF's vocabulary
            # again takes seconds (no Mistral regex patch: as load_tokenizer says)
            tokenizer = (AutoTokenizer.from_pretrained(out_dir, fix_mistral_regex=False)
                         if (out_dir / "tokenizer_config.json").is_file()
                         else AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name))
            model = AutoModelForCausalLM.from_pretrained(
                gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32, low_cpu_mem_usage=True
            )
    except Exception as exc:  # the GGUF reader fails with anything from ValueError to IndexError on bad bytes
        raise ModelIntegrityError(
            f"{gguf_file} is not a loadable GGUF model ({exc}); re-download it or pass another file."
        ) from exc
    with atomic_directory(out_dir) as scratch:
        model.save_pretrained(scratch, safe_serialization=True)
        tokenizer.save_pretrained(scratch)
    _say(f"converted in {time.perf_counter() - start:.0f} s")
    return out_dir


def _gguf_metadata_to_hf(gguf_file: Path, out_dir: Path) -> Path:
    """The weight-free folder: what ``save_pretrained`` would write beside the weights, from the metadata. The
    metadata is parsed once (``AutoConfig`` and ``AutoTokenizer`` would each parse it again) and given to
    transformers' own GGUF converters."""
    from transformers import AutoConfig, GenerationConfig
    from transformers.integrations.ggml import convert_gguf_tokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint
    from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

    try:
        with _plain_gguf_parsing():
            parsed = load_gguf_checkpoint(str(gguf_file), return_tensors=False)
        config = AutoConfig.for_model(**parsed["config"])
        backend, extra = convert_gguf_tokenizer(config.model_type, parsed["tokenizer"])
        tokenizer_class = TOKENIZER_MAPPING[type(config)][1]
        tokenizer = tokenizer_class(tokenizer_object=backend, **{**parsed["tokenizer_config"], **extra})
    except Exception as exc:  # as above: the reader's errors on bad bytes are of every kind
        raise ModelIntegrityError(
            f"{gguf_file} is not a loadable GGUF model ({exc}); re-download it or pass another file."
        ) from exc
    if not config.architectures:  # the GGUF names a family, not a class: the family's causal LM, as a full save says
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

        config.architectures = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    with atomic_directory(out_dir) as scratch:
        config.save_pretrained(scratch)
        GenerationConfig.from_model_config(config).save_pretrained(scratch)
        tokenizer.save_pretrained(scratch)
    return out_dir


def has_weights(hf_dir: Path) -> bool:
    return any(hf_dir.glob("*.safetensors"))


def drop_weights(hf_dir: Path) -> int:
    """Delete a converted folder's float32 weights (the GGUF holds them; ``gguf_to_hf`` writes them again when a
    graph build or the torch backend needs them); the tokenizer and config stay. Returns the bytes freed."""
    freed = 0
    for path in [*hf_dir.glob("*.safetensors"), *hf_dir.glob("*.safetensors.index.json")]:
        freed += path.stat().st_size
        path.unlink()
    return freed


# graph precisions: fp32 (the source weights as they are), int8 (MatMulNBits 8-bit, block 32: close to the GGUF's
# own weights), int4 (MatMulNBits 4-bit, block 32: a second 4-bit rounding, drafters' default)
PRECISIONS = ("fp32", "int8", "int4")
# what a target may run at: a graph above, or "gguf": the GGUF file itself, run by llama.cpp
GGUF = "gguf"
TARGET_PRECISIONS = (*PRECISIONS, GGUF)


def hf_to_onnx(hf_dir: Path, out_dir: Path, int4: bool) -> Path:
    """Build an ONNX Runtime graph of a causal LM (onnxruntime-genai's model builder), fp32 or int4.

    Why this builder and not a generic tracer: it emits fused GroupQueryAttention (rotary embedding inside,
    no repeated KV heads, no per-step mask arithmetic) and MatMulNBits weights, faster at every context length
    (docs/design.md). A GGUF of a family gguf_graph.py writes skips this (``gguf_graph``).
    """
    if onnx_model_file(out_dir).is_file():
        return out_dir
    if importlib.util.find_spec("onnxruntime_genai") is None:
        raise ModelIntegrityError(
            "the ONNX backend needs the model builder of onnxruntime-genai: pip install 'fly-integrations[onnx]'"
        )
    kind = "int4" if int4 else "fp32"
    _say(f"building the ONNX {kind} graph of {hf_dir.name} (once; about a minute; cached in {out_dir}) ...")
    start = time.perf_counter()
    with atomic_directory(out_dir) as scratch:
        command = [
            sys.executable, "-m", "onnxruntime_genai.models.builder",
            "--input", str(hf_dir), "--output", str(scratch), "--precision", kind,
            "--execution_provider", "cpu", "--cache_dir", str(scratch / "build-cache"),
        ]
        if int4:
            command += ["--extra_options", "int4_accuracy_level=4", "int4_block_size=32"]
        # the builder logs every node; keep that in a file and show its tail only if it fails.
        # It reads the local folder only, never the Hub.
        log = scratch.parent / f"{out_dir.name}.build.log"
        with log.open("w") as sink:
            done = subprocess.run(command, env=os.environ | {"HF_HUB_OFFLINE": "1"}, stdout=sink,
                                  stderr=subprocess.STDOUT, check=False)
        if done.returncode != 0 or not (scratch / "model.onnx").is_file():
            tail = log.read_text(errors="replace")[-2000:]
            log.unlink()  # its tail is in the message; nothing of a failed build stays in the cache
            raise ModelIntegrityError(
                f"building the ONNX graph of {hf_dir} failed (exit {done.returncode}); the builder said:\n{tail}\n"
                "Check that the folder holds a complete model (config.json with its architecture, the weights "
                "and the tokenizer). The builder supports the common decoder families (Llama, Mistral, "
                "Qwen2/3, Phi, Gemma, ...); for another architecture use backend='torch'."
            )
        shutil.rmtree(scratch / "build-cache", ignore_errors=True)
        log.unlink()
        add_logits_to_keep(scratch / "model.onnx")
        shutil.copy2(hf_dir / "config.json", scratch / "config.json")
    _say(f"built in {time.perf_counter() - start:.0f} s")
    return out_dir


def gguf_buildable(gguf_file: Path, record_dir: Path | None = None) -> bool:
    """Does gguf_graph.py write this GGUF's family? gguf-py parses every field to say, the vocabulary's too (about
    ten seconds for a Qwen2.5 file), so the answer is kept in ``record_dir`` (the GGUF's tokenizer folder, keyed by
    the file's identity) and the parsed file for the build that usually follows."""
    from fly_runtime.sources.gguf_graph import Unsupported, read_layout

    record = record_dir / LAYOUT_RECORD if record_dir is not None else None
    if record is not None and record.is_file():
        return json.loads(record.read_text())["writes"]
    reader = _reader(gguf_file)
    try:
        layout, why = read_layout(reader.fields, {t.name: t for t in reader.tensors}).__dict__, None
    except Unsupported as exc:
        layout, why = None, str(exc)
    if record is not None:
        record.write_text(json.dumps({"writes": why is None, "layout": layout, "unsupported": why}))
    return why is None


# in a GGUF's tokenizer folder: whether gguf_graph.py writes its graphs, and its layout (or why not)
LAYOUT_RECORD = "gguf_layout.json"


def _reader(gguf_file: Path):
    stat = gguf_file.stat()
    return _parsed(str(gguf_file), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=1)
def _parsed(path: str, size: int, mtime: int):
    return _plain_reader()(path)


@functools.cache
def _plain_reader():
    import numpy as np
    from gguf import GGUFReader

    class PlainReader(GGUFReader):
        """gguf-py's reader over a plain array view of its map: numpy's memmap subclass costs microseconds a slice,
        and the fields of a 150k-token vocabulary are millions of slices (2 s instead of 10)."""

        @property
        def data(self):
            return self._plain

        @data.setter
        def data(self, mapped) -> None:
            self._plain = mapped.view(np.ndarray)

    return PlainReader


_parsing = threading.Lock()


def _shared_reader(path, mode: str = "r"):
    """The plain reader, with a read-only parse shared with ``_reader`` (a first run parses the file for its
    tokenizer folder and again to tell whether its graph is written from it: seconds each)."""
    return _reader(Path(path)) if mode == "r" else _plain_reader()(path, mode)


@contextlib.contextmanager
def _plain_gguf_parsing():
    """transformers' GGUF loaders look gguf-py's reader up by name when called: within this block they get the plain
    one. Conversions within it run one at a time, so that the name is put back as it was."""
    import gguf

    _plain_reader()  # made from gguf-py's class, before the name is replaced
    with _parsing:
        original = gguf.GGUFReader
        gguf.GGUFReader = _shared_reader
        try:
            yield
        finally:
            gguf.GGUFReader = original


def gguf_graph(gguf_file: Path, out_dir: Path, precision: str, config_file: Path) -> bool:
    """Write the ``precision`` (int4 / int8) graph of a GGUF into ``out_dir`` straight from its tensors; False,
    with nothing kept, where its family is not one gguf_graph.py writes."""
    from fly_runtime.sources.gguf_graph import Unsupported, build_from_gguf

    if not gguf_buildable(gguf_file, config_file.parent):
        return False
    _say(f"writing the {precision} ONNX graph of {gguf_file.name} from its own weights (once; seconds; cached in "
         f"{out_dir}) ...")
    try:
        with atomic_directory(out_dir) as scratch:
            counts = build_from_gguf(_reader(gguf_file), scratch, int(precision[3:]), config_file, say=_say)
            (scratch / GRID_RECORD).write_text(json.dumps(counts))
    except Unsupported as exc:  # a tensor the metadata did not announce: the builder's way instead
        _say(f"{gguf_file.name} is not written directly ({exc}); building from float32 weights instead")
        return False
    finally:
        _parsed.cache_clear()  # the parsed file maps the whole GGUF: what the build touched counts as resident
    return True


# beside a graph written from a GGUF: how many matrices kept the file's own grid, and how many were rounded
GRID_RECORD = "gguf_grid.json"


def on_own_grid(onnx_dir: Path) -> bool:
    """Is every matrix of this graph on its GGUF's own grid, so that it computes the file's model as llama.cpp
    does (both round activations to 8 bits), with nothing of its own to check?"""
    try:
        return json.loads((onnx_dir / GRID_RECORD).read_text())["rounded"] == 0
    except (OSError, ValueError, KeyError):
        return False


LOGITS_TO_KEEP = "logits_to_keep"


def add_logits_to_keep(model_file: Path) -> None:
    """Give the graph an int64 input ``logits_to_keep``: the LM head runs on the last N positions only.

    A prefill needs the logits of its last position alone, yet the head over a large vocabulary is a sizeable
    share of a small model's prefill. Only the graph file is rewritten; the weights stay in their external
    data file.
    """
    import onnx
    from onnx import TensorProto, helper

    model = onnx.load(str(model_file), load_external_data=False)
    graph = model.graph
    index, head = next((i, n) for i, n in enumerate(graph.node) if "logits" in n.output)
    graph.input.append(helper.make_tensor_value_info(LOGITS_TO_KEEP, TensorProto.INT64, [1]))
    graph.initializer.extend([
        helper.make_tensor("/fly/keep_ends", TensorProto.INT64, [1], [2**62]),
        helper.make_tensor("/fly/keep_axes", TensorProto.INT64, [1], [1]),  # hidden states are [B, S, H]
    ])
    hidden = head.input[0]
    slicing = [
        helper.make_node("Neg", [LOGITS_TO_KEEP], ["/fly/keep_starts"], name="/fly/KeepStarts"),
        helper.make_node("Slice", [hidden, "/fly/keep_starts", "/fly/keep_ends", "/fly/keep_axes"],
                         ["/fly/kept_hidden"], name="/fly/KeepLastPositions"),
    ]
    head.input[0] = "/fly/kept_hidden"
    for offset, node in enumerate(slicing):
        graph.node.insert(index + offset, node)
    logits = next(o for o in graph.output if o.name == "logits")
    logits.type.tensor_type.shape.dim[1].dim_param = LOGITS_TO_KEEP
    onnx.save(model, str(model_file))


def quantize_onnx(fp32_dir: Path, out_dir: Path, bits: int = 8) -> Path:
    """An ``bits``-bit copy of an fp32 graph: every MatMul weight as MatMulNBits (block 32, asymmetric) whose
    activations are quantised per row and block (accuracy level 4), so a pass over K tokens computes each row
    as a one-token step does and exact verification stays token-identical to plain decoding."""
    if onnx_model_file(out_dir).is_file():
        return out_dir
    import logging

    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    logging.getLogger("onnxruntime.quantization.matmul_nbits_quantizer").setLevel(logging.WARNING)  # a line a node

    _say(f"quantising {fp32_dir.name} to {bits}-bit weights (once; about a minute; cached in {out_dir}) ...")
    start = time.perf_counter()
    with atomic_directory(out_dir) as scratch:
        quantizer = MatMulNBitsQuantizer(str(onnx_model_file(fp32_dir)), bits=bits, block_size=32,
                                         is_symmetric=False, accuracy_level=4)
        quantizer.process()
        quantizer.model.save_model_to_file(str(onnx_model_file(scratch)), use_external_data_format=True)
        for name in ("config.json",):
            shutil.copy2(fp32_dir / name, scratch / name)
    _say(f"quantised in {time.perf_counter() - start:.0f} s")
    return out_dir

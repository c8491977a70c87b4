"""One-time conversions into the cache: GGUF -> Hugging Face directory, Hugging Face -> ONNX (fp32 / int8)."""

from __future__ import annotations

import shutil
import sys
import time
from pathlib import Path

from fly_runtime.errors import ModelIntegrityError
from fly_runtime.sources.cache import atomic_directory


def _say(message: str) -> None:
    print(f"fly: {message}", file=sys.stderr, flush=True)


def onnx_model_file(onnx_dir: Path) -> Path:
    """The graph inside an export folder: Optimum's quantizer writes ``model_quantized.onnx``."""
    quantized = onnx_dir / "model_quantized.onnx"
    return quantized if quantized.is_file() else onnx_dir / "model.onnx"


def gguf_to_hf(gguf_file: Path, out_dir: Path) -> Path:
    """Dequantise a GGUF into a float32 Hugging Face directory (weights + tokenizer + chat template).

    transformers reads GGUF directly but slowly (the tokenizer alone takes ~15 s); converting once makes
    every later load a plain safetensors load.
    """
    if (out_dir / "config.json").is_file():
        return out_dir
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _say(f"converting {gguf_file.name} to a Hugging Face model (once; cached in {out_dir}) ...")
    start = time.perf_counter()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
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


def hf_to_onnx(hf_dir: Path, out_dir: Path, int8: bool) -> Path:
    """Export a causal LM to ONNX with its KV cache as inputs/outputs (Optimum), optionally int8-quantised.

    int8 uses dynamic quantisation with Optimum's AVX2 configuration: activation scales are computed per
    pass, which is fine for a drafter (its numerics never change what the target accepts in exact mode)
    but not for a target.
    """
    if onnx_model_file(out_dir).is_file():
        return out_dir
    from optimum.exporters.onnx import main_export

    kind = "int8" if int8 else "fp32"
    _say(f"exporting {hf_dir.name} to ONNX {kind} (once; a few minutes; cached in {out_dir}) ...")
    start = time.perf_counter()
    with atomic_directory(out_dir) as scratch:
        export_dir = scratch / "fp32" if int8 else scratch
        main_export(
            str(hf_dir),
            output=export_dir,
            task="text-generation-with-past",
            device="cpu",
            do_validation=False,
            local_files_only=True,
        )
        if int8:
            from optimum.onnxruntime import ORTQuantizer
            from optimum.onnxruntime.configuration import AutoQuantizationConfig

            _say("quantising to int8 (dynamic, AVX2) ...")
            quantizer = ORTQuantizer.from_pretrained(export_dir, file_name="model.onnx")
            config = AutoQuantizationConfig.avx2(is_static=False, per_channel=False)
            # the quantised graph names its external-data file, so the files keep Optimum's names
            quantizer.quantize(save_dir=scratch, quantization_config=config, use_external_data_format=True)
            for extra in export_dir.iterdir():
                if not extra.name.startswith("model.onnx") and not (scratch / extra.name).exists():
                    extra.rename(scratch / extra.name)
            shutil.rmtree(export_dir)
    _say(f"exported in {time.perf_counter() - start:.0f} s")
    return out_dir

"""Widening a GGUF's Q4_K and Q6_K blocks to bfloat16 in C, built once per machine with the system's compiler.

Why: the prompt reader multiplies in bfloat16, and its weights are the GGUF's. Kept as int8 rows they cost a byte a
weight beside the GGUF (1.31 GB for the 1.5B's layers); widened from the GGUF's own blocks (0.79 GB there, 4.8 bits a
weight, pages the file already holds) they cost nothing beside it and are the GGUF's values exactly. PyTorch decodes
a layer's blocks in ~250 ms (35 times the int8 rows' widening); this loop does it in a few milliseconds. Its values
are bit-equal to ``bf16_reader._q4_k`` / ``_q6_k`` rounded to bfloat16 (products not fused: ``-ffp-contract=off``).

Built with ``-march=native`` for this CPU into the fly cache, named by the source, compiler and CPU, so a cache moved
to another CPU builds anew. Where no C compiler works (``CC``, else ``cc``), ``available()`` is False and the reader
keeps int8 rows as before.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import threading
from pathlib import Path

SOURCE = r"""
#include <stdint.h>
#include <string.h>

static float half_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16, exponent = (h >> 10) & 0x1F, mantissa = h & 0x3FF, u;
    float f;
    if (exponent == 0) {
        f = (float)mantissa * (1.0f / 16777216.0f);  /* zero or subnormal: mantissa * 2^-24 */
        memcpy(&u, &f, 4);
        u |= sign;
    } else if (exponent == 31) {
        u = sign | 0x7F800000u | (mantissa << 13);
    } else {
        u = sign | ((exponent + 112) << 23) | (mantissa << 13);
    }
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) {  /* round to nearest, ties to even, as PyTorch converts */
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7FFF + ((u >> 16) & 1);
    return (uint16_t)(u >> 16);
}

/* Q4_K super-blocks (144 bytes: d, dmin, 12 bytes of 6-bit scales and minimums, 128 of nibbles) to bfloat16:
   each 32 weights d * scale * q - dmin * minimum */
void widen_q4_k(const uint8_t *blocks, uint16_t *out, int64_t n_blocks, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *x = blocks + 144 * b, *s = x + 4, *qs = x + 16;
        uint16_t *y = out + 256 * b, dh, mh;
        memcpy(&dh, x, 2);
        memcpy(&mh, x + 2, 2);
        const float d = half_to_float(dh), dmin = half_to_float(mh);
        for (int c = 0; c < 4; c++) {
            float a[2], m[2];
            for (int h = 0; h < 2; h++) {
                int j = 2 * c + h, sc, mn;
                if (j < 4) { sc = s[j] & 63; mn = s[j + 4] & 63; }
                else { sc = (s[j + 4] & 0xF) | ((s[j - 4] >> 6) << 4); mn = (s[j + 4] >> 4) | ((s[j] >> 6) << 4); }
                a[h] = d * (float)sc;
                m[h] = dmin * (float)mn;
            }
            const uint8_t *q = qs + 32 * c;
            for (int l = 0; l < 32; l++) y[64 * c + l] = to_bf16((float)(q[l] & 0xF) * a[0] - m[0]);
            for (int l = 0; l < 32; l++) y[64 * c + 32 + l] = to_bf16((float)(q[l] >> 4) * a[1] - m[1]);
        }
    }
}

/* Q6_K super-blocks (210 bytes: 128 of low bits, 64 of high bits, 16 int8 scales, d) to bfloat16:
   each 16 weights d * scale * (q - 32) */
void widen_q6_k(const uint8_t *blocks, uint16_t *out, int64_t n_blocks, int threads) {
    #pragma omp parallel for schedule(static) num_threads(threads)
    for (int64_t b = 0; b < n_blocks; b++) {
        const uint8_t *x = blocks + 210 * b;
        const int8_t *scales = (const int8_t *)(x + 192);
        uint16_t dh;
        memcpy(&dh, x + 208, 2);
        const float d = half_to_float(dh);
        for (int h = 0; h < 2; h++) {  /* 128 weights each: 64 bytes of low bits, 32 of high bits */
            const uint8_t *ql = x + 64 * h, *qh = x + 128 + 32 * h;
            const int8_t *s = scales + 8 * h;
            uint16_t *o = out + 256 * b + 128 * h;
            for (int is = 0; is < 2; is++) {
                const float s0 = d * (float)s[is], s2 = d * (float)s[is + 2];
                const float s4 = d * (float)s[is + 4], s6 = d * (float)s[is + 6];
                for (int l = 16 * is; l < 16 * is + 16; l++) {
                    o[l] = to_bf16((float)(((ql[l] & 0xF) | ((qh[l] & 3) << 4)) - 32) * s0);
                    o[l + 32] = to_bf16((float)(((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) - 32) * s2);
                    o[l + 64] = to_bf16((float)(((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32) * s4);
                    o[l + 96] = to_bf16((float)(((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32) * s6);
                }
            }
        }
    }
}
"""

Q4_K, Q6_K = 12, 14  # ggml type ids
BLOCK_BYTES = {Q4_K: 144, Q6_K: 210}  # per super-block of 256 weights

_lock = threading.Lock()
_library: ctypes.CDLL | None = None
_tried = False


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


def _compiler() -> str | None:
    """The C compiler the widening is built with: ``CC``, else ``cc`` or ``gcc`` on the path."""
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")


def _build(folder: Path) -> Path | None:
    """The library built for this machine (built now if absent), or None where no compiler builds it."""
    compiler = _compiler()
    if not compiler:
        return None
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    tag = hashlib.sha256("\0".join([SOURCE, compiler, version, platform.machine(), _cpu()]).encode()).hexdigest()[:16]
    library = folder / f"widen-{tag}.so"
    if library.is_file():
        return library
    source = folder / f"widen-{tag}.{os.getpid()}.c"
    partial = library.with_suffix(f".{os.getpid()}.partial")
    try:
        folder.mkdir(parents=True, exist_ok=True)  # a read-only cache: no widening (int8 rows instead)
        source.write_text(SOURCE)
        for flags in (["-march=native", "-fopenmp"], ["-fopenmp"], []):  # the fastest this compiler takes
            done = subprocess.run([compiler, "-O3", *flags, "-ffp-contract=off", "-shared", "-fPIC", "-o",
                                   str(partial), str(source)], capture_output=True, timeout=120)
            if done.returncode == 0:
                partial.replace(library)
                return library
    except (OSError, subprocess.SubprocessError):
        pass
    finally:
        for leftover in (source, partial):
            with contextlib.suppress(OSError):
                leftover.unlink(missing_ok=True)
    return None


def _load() -> ctypes.CDLL | None:
    global _library, _tried
    with _lock:
        if not _tried:
            _tried = True
            from fly_runtime.sources.cache import cache_dir

            path = _build(cache_dir() / "kernels")
            if path is not None:
                try:
                    library = ctypes.CDLL(str(path))
                except OSError:  # built for another CPU after all, or a broken file: rebuilt next process
                    path.unlink(missing_ok=True)
                else:
                    for name in ("widen_q4_k", "widen_q6_k"):
                        getattr(library, name).argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                                           ctypes.c_int]
                    _library = library
        return _library


def buildable() -> bool:
    """Whether the library is built or a compiler is there to build it (nothing is built here: a cheap guess)."""
    return _library is not None or (not _tried and _compiler() is not None)


def available() -> bool:
    """Whether the widening library is built (or builds now) on this machine."""
    return _load() is not None


def widen(kind: int, blocks, out, threads: int = 1) -> None:
    """``blocks``: a C-contiguous numpy uint8 array of ``kind``'s super-blocks; ``out``: a contiguous bfloat16 torch
    tensor of 256 values a block, written in place."""
    library = _load()
    if library is None:
        raise RuntimeError("the widening library is not built on this machine")
    n_blocks = blocks.size // BLOCK_BYTES[kind]
    if out.numel() != 256 * n_blocks or not out.is_contiguous() or not blocks.flags["C_CONTIGUOUS"]:
        raise ValueError(f"{n_blocks} blocks widen into {256 * n_blocks} contiguous values, not {out.numel()}")
    function = library.widen_q4_k if kind == Q4_K else library.widen_q6_k
    function(blocks.ctypes.data, out.data_ptr(), n_blocks, threads)

"""The process's one thread for OpenMP work: every llama.cpp pass, load and cache move, and the prompt reader's
torch products, whoever asks for them (as llama-server decodes on its one main loop).

llama.cpp's CPU kernels run under OpenMP, which keeps a team of worker threads for each thread that starts
parallel work, and the idle teams of other callers spin on the same cores (docs/design.md, "Batched decoding", has
the cost). torch shares that OpenMP runtime (its libgomp is the one loaded): once the process holds more team
threads than cores, libgomp cuts the spin-waits llama.cpp's per-step barriers rely on, and every llama.cpp step
after is slower for good (72 -> 91 ms on a 2-core AMX Xeon).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, wait

_ON_THREAD = threading.local()


def _mark() -> None:
    _ON_THREAD.on = True


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fly-openmp", initializer=_mark)


def on_openmp_thread(work, *args):
    """``work(*args)`` run on the process's one OpenMP thread, its result returned; called there, run at once. A
    Ctrl-C while waiting lets the work end first, so no one crops a cache in the middle of a pass."""
    if getattr(_ON_THREAD, "on", False):
        return work(*args)
    running = _EXECUTOR.submit(work, *args)
    try:
        return running.result()
    except BaseException:
        wait([running])
        raise

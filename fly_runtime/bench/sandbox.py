"""Run model-written code (HumanEval answers) confined: its own temp folder, a minimal environment, resource
limits, no network where the platform allows, and its whole process group killed when it ends or times out.

Not a full sandbox: the code can still read (and, as the same user, write) files outside its folder. Run the
benchmark as an unprivileged user, or in a container, for untrusted models.
"""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Limits:
    memory_bytes: int = 1 << 30  # address space
    file_bytes: int = 16 << 20  # largest file it may write
    processes: int = 32  # per user; not enforced for root
    open_files: int = 64


@dataclass
class Outcome:
    returncode: int | None  # None: killed at the timeout
    stdout: str
    stderr: str

    @property
    def passed(self) -> bool:
        return self.returncode == 0


@functools.cache
def network_wrapper() -> tuple[str, ...]:
    """The command prefix that gives a child a network namespace of its own (no interfaces up: no network),
    or () where this platform cannot (then the code runs with the machine's network)."""
    unshare = shutil.which("unshare")
    if unshare is None:
        return ()
    for flags in (("-n",), ("-r", "-n")):  # as root; else as an unprivileged user in a user namespace
        try:
            if subprocess.run([unshare, *flags, "true"], capture_output=True, timeout=10).returncode == 0:
                return (unshare, *flags)
        except (OSError, subprocess.TimeoutExpired):
            continue
    return ()


def network_isolated() -> bool:
    return bool(network_wrapper())


def _limit(limits: Limits, cpu_seconds: int) -> None:  # runs in the child before exec
    import resource

    for kind, value in ((resource.RLIMIT_AS, limits.memory_bytes), (resource.RLIMIT_FSIZE, limits.file_bytes),
                        (resource.RLIMIT_NPROC, limits.processes), (resource.RLIMIT_NOFILE, limits.open_files),
                        (resource.RLIMIT_CPU, cpu_seconds), (resource.RLIMIT_CORE, 0)):
        try:
            resource.setrlimit(kind, (value, value))
        except (ValueError, OSError):
            pass  # a hard limit already lower stays


def run_python(program: str, timeout: float, limits: Limits = Limits()) -> Outcome:
    """Run ``program`` with this Python in isolated mode (-I: no user site, no PYTHON* variables), confined."""
    with tempfile.TemporaryDirectory(prefix="fly-sandbox-") as folder:
        path = Path(folder) / "solution.py"
        path.write_text(program)
        env = {"PATH": "/usr/bin:/bin", "HOME": folder, "TMPDIR": folder, "LANG": "C.UTF-8"}
        proc = subprocess.Popen(
            [*network_wrapper(), sys.executable, "-I", str(path)], cwd=folder, env=env, stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
            preexec_fn=functools.partial(_limit, limits, int(timeout) + 1))
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
            code: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            code = None
            _kill_group(proc.pid)
            stdout, stderr = proc.communicate()
        finally:
            _kill_group(proc.pid)  # what it started and left running goes too
    return Outcome(code, stdout, stderr)


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

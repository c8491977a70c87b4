"""Benchmark code runs confined: no network, a memory limit, a scrubbed environment, and nothing it started
survives it."""

import socket
import time

import pytest

from fly_runtime.bench.sandbox import Limits, network_isolated, run_python


def test_the_environment_is_scrubbed(monkeypatch):
    monkeypatch.setenv("FLY_CANARY", "secret")
    out = run_python("import os; print(sorted(os.environ))", timeout=20)
    assert out.passed and "FLY_CANARY" not in out.stdout and "HOME" in out.stdout


def test_network_is_refused():
    if not network_isolated():  # said plainly by the bench too; this machine's kind has unshare
        pytest.skip("this platform cannot give the child a network namespace (no usable unshare)")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        program = f"import socket\ns = socket.socket()\ns.settimeout(2)\nprint(s.connect_ex(('127.0.0.1', {port})))"
        out = run_python(program, timeout=20)
    assert out.passed and out.stdout.strip() != "0"  # the host's listening socket is unreachable


def test_memory_beyond_the_limit_fails():
    out = run_python("blob = bytearray(800 * 2**20)\nprint(len(blob))", timeout=20, limits=Limits(memory_bytes=512 << 20))
    assert not out.passed and "MemoryError" in out.stderr


def test_a_timeout_kills_what_the_code_started(tmp_path):
    pid_file = tmp_path / "grandchild.pid"
    program = (f"import subprocess, time\np = subprocess.Popen(['sleep', '60'])\n"
               f"open({str(pid_file)!r}, 'w').write(str(p.pid))\ntime.sleep(60)\n")
    start = time.perf_counter()
    out = run_python(program, timeout=2)
    assert out.returncode is None and time.perf_counter() - start < 30
    assert not running(int(pid_file.read_text()))


def running(pid: int) -> bool:
    """Alive and not a zombie (a killed orphan waits as one until the container's init reaps it)."""
    time.sleep(0.2)
    try:
        state = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_large_file_write_is_stopped():
    out = run_python("open('big', 'wb').write(b'x' * (64 << 20))", timeout=20, limits=Limits(file_bytes=1 << 20))
    assert not out.passed

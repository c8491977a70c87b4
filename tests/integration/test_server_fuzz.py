"""`fly serve` checked against its own OpenAPI document by schemathesis (a tool nobody here wrote): requests
generated from the document, valid and not, each answered within its bound, with a status, content type, headers
and body the document states, valid ones accepted and invalid ones refused, no server error; then the server
still answers. Two rules that span fields, which JSON Schema cannot state, are kept out of the generated bodies
(schemathesis_hooks.py)."""

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import EXTERNAL, KEY, launch_server

TIMEOUT = 2  # --request-timeout: every request, however large its max_tokens, ends within this


@pytest.fixture(scope="module")
def fuzzed(tmp_path_factory):
    if EXTERNAL:
        pytest.skip("fuzzes a fly serve of its own, with a request timeout")
    log = open(tmp_path_factory.mktemp("fuzz") / "serve.log", "w+")
    proc, base = launch_server(["--request-timeout", str(TIMEOUT), "--max-new-tokens", "2"], log)
    yield base
    proc.terminate()
    proc.wait(timeout=60)
    log.close()


@pytest.mark.parametrize("phases, checks", [
    # every generated body, valid or not, and every check; two rules that span fields kept out by the hooks
    ("examples,fuzzing", ["--checks", "all"]),
    # boundary values of every field; the hooks do not reach this phase, so valid bodies that break a rule spanning
    # two fields are not counted as wrongly refused
    ("coverage", ["--checks", "all", "--exclude-checks", "positive_data_acceptance"]),
])
def test_schemathesis_finds_the_server_doing_what_its_document_says(fuzzed, tmp_path, phases, checks):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, SCHEMATHESIS_HOOKS="tests.integration.schemathesis_hooks",
               PYTHONPATH=os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "schemathesis"), "run", fuzzed + "/openapi.json",
         "-H", f"Authorization: Bearer {KEY}", "--phases", phases, *checks, "--max-examples", "25", "--seed", "7",
         "--workers", "1", "--request-timeout", str(TIMEOUT + 30), "--max-response-time", str(TIMEOUT + 30),
         "--suppress-health-check", "all", "--report-dir", str(tmp_path)],
        capture_output=True, text=True, cwd=tmp_path, env=env, timeout=1200)  # its cache stays out of the checkout
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert " generated" in proc.stdout


def test_the_server_still_answers_after_the_fuzzing(fuzzed):
    assert httpx.get(fuzzed + "/health", timeout=10).json()["status"] == "ok"
    ok = httpx.post(fuzzed + "/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                    json={"messages": [{"role": "user", "content": "Say OK."}], "max_tokens": 4})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["role"] == "assistant"

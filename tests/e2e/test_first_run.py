"""README command 1 on a machine that never built the swap ops (empty HOME and ops cache): the
supervisor builds them once before any process is ready, and a Ctrl-C during that build leaves
nothing behind. Each test compiles the ops (~15 s on an idle machine)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.e2e.test_supervisor import leftovers, wait_for
from tests.optional import require_paddle
from tests.procs import processes_mentioning

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
BUILDING = "building the swap ops for this machine"


def first_run(tmp_path: Path, *argv: str, **kwargs) -> tuple[subprocess.Popen, Path]:
    require_paddle()
    home, cache = tmp_path / "home", tmp_path / "ops-cache"
    home.mkdir()
    cache.mkdir()
    env = {**os.environ, "HOME": str(home), "FASTKV_OPS_CACHE": str(cache), "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(tmp_path / "out"), *argv]
    return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs), cache


def test_first_run_builds_the_ops_before_any_process_is_ready(tmp_path):
    proc, cache = first_run(tmp_path)
    out, err = proc.communicate(timeout=580)
    assert proc.returncode == 0, err
    assert err.count(BUILDING) == 1 and " done in " in err, err
    assert "restarted" not in err, f"a transfer process was restarted:\n{err}"
    assert len(list(cache.glob("*/fastkv_ops.so"))) == 1
    assert not list(cache.glob("*/.build-*"))
    assert "hit ratio" in out
    # A clean run stops no process by signal: each rank exits when the engine closes its channels.
    assert "killing" not in err, err
    for log in (tmp_path / "out" / "logs").glob("*.log"):
        text = log.read_text()
        assert "Termination signal" not in text and "SIGTERM" not in text, f"{log.name}:\n{text[-2000:]}"


def test_ctrl_c_during_the_build_stops_promptly_leaving_nothing(tmp_path):
    rid = f"t{uuid.uuid4().hex[:12]}"
    proc, cache = first_run(tmp_path, "--run-id", rid)
    try:
        wait_for(lambda: any("cc1plus" in p for p in processes_mentioning(str(cache))), "the compiler",
                 timeout=300, proc=proc)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 130, err
    assert "interrupted by SIGINT while building the swap ops" in err, err
    wait_for(lambda: not processes_mentioning(str(cache)), "every build process to end", timeout=30)
    assert not list(cache.glob("*/.build-*"))
    assert leftovers(rid) == []

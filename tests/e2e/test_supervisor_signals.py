"""SIGINT/SIGTERM to fastkv-supervisor at any moment: the run ends within 5 s, with its
summary.json and a results.jsonl line per request, and nothing of it is left in /dev/shm."""
from __future__ import annotations

import json
import signal
import time

import pytest

from tests.e2e.test_supervisor import SHM, finish, leftovers, run_id, start_cli

pytestmark = pytest.mark.timeout(600)
STOP_WITHIN_S = 5.0


def signal_and_check(tmp_path, proc, rid: str, signum: int, what: str) -> dict:
    """Sends ``signum``; asserts the run ended within STOP_WITHIN_S, cleanly; returns the summary
    (None when the signal came before the CLI's main() ran: then nothing may exist)."""
    sent = time.monotonic()
    proc.send_signal(signum)
    code, _, err = finish(proc, 60)
    took = time.monotonic() - sent
    assert leftovers(rid) == [], f"{what}: leaked {leftovers(rid)}"
    assert not (SHM / f"fkv.{rid}.manifest.json").exists()
    if code == -signum:  # killed by the default action: main() had not started the run
        assert "fastkv-supervisor: run " not in err, f"{what}: killed by {signum} after the run started:\n{err}"
        return None
    assert code == 128 + signum, f"{what}: exit {code}\n{err}"
    assert took < STOP_WITHIN_S, f"{what}: took {took:.1f} s to stop"
    out = tmp_path / "out"
    summary = json.loads((out / "summary.json").read_text())
    requests = [json.loads(line)["id"] for line in (out / "workload.jsonl").read_text().splitlines()]
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == sorted(requests), what
    assert all(r["state"] in ("finished", "aborted", "rejected", "unfinished") for r in rows), what
    assert sum(summary["states"].values()) == len(requests), what
    return summary


def test_sigterm_at_every_moment_of_startup_leaks_nothing(tmp_path):
    """0.1 s steps over the first 3 s: the supervisor's start-up (imports, Paddle's, shared
    memory, spawning) must have no window where a SIGTERM kills it with shared memory made."""
    for step in range(1, 31):
        offset = step / 10
        rid = run_id()
        path = tmp_path / f"at{step}"
        path.mkdir()
        proc = start_cli(path, rid, standin_request_s=1.0)
        time.sleep(offset)  # the moment under test
        signal_and_check(path, proc, rid, signal.SIGTERM, f"SIGTERM at {offset:.1f} s")

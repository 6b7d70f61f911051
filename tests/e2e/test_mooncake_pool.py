"""Mooncake as the KV pool that outlives engines, through the user's own command: a restarted
supervisor serves the trace from the pool, two engines share it at once (also at tp 2), and a
run whose master or holder is killed mid-run finishes with the same outputs, the faults counted.
Each test starts its own mooncake_master and holder on free loopback ports."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fastkv.storage.local_mooncake import LocalMooncake
from tests.e2e.launch import new_run_id
from tests.e2e.test_storage_pool import two_engines_at_once
from tests.storage.conftest import require_mooncake

pytestmark = [pytest.mark.slow, pytest.mark.mooncake]
ROOT = Path(__file__).resolve().parents[2]
TRACE = "trace:64"


def supervisor(out: Path, url: str, workload: str) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastkv", "--no-progress", "--out", str(out), "--storage", url,
           "--workload", workload]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, out: Path) -> tuple[dict[str, list], dict, str]:
    """Outputs by request id, report.json and stderr of a finished run."""
    stdout, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 0, f"run {out.name} failed:\n{stdout}\n{stderr}"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    assert all(r["state"] == "finished" for r in rows), rows
    return {r["id"]: r["output"] for r in rows}, json.loads((out / "report.json").read_text()), stderr


def run(out: Path, url: str, workload: str = TRACE):
    return finish(supervisor(out, url, workload), out)


def kill_once_started(proc: subprocess.Popen, out: Path, kill, after_s: float,
                      marker: str = "workload.jsonl") -> None:
    """Calls ``kill`` ``after_s`` seconds after the run wrote ``marker`` (its workload: it then
    checks the pool and starts its engine; a transfer process's log: the pool passed its check
    and the run is starting): mid-run, with storage in use."""
    deadline = time.monotonic() + 240
    while not (out / marker).is_file():
        assert proc.poll() is None, "the run ended before it started"
        assert time.monotonic() < deadline, "the run did not start within 240 s"
        time.sleep(0.05)
    time.sleep(after_s)
    assert proc.poll() is None, "the run ended before the fault"
    kill()


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The trace's outputs without a storage tier (the synthetic runner's tokens hash the KV)."""
    out = tmp_path_factory.mktemp("ref") / "ref"
    outputs, _, _ = run(out, "none")
    return outputs


@pytest.fixture
def pool():
    require_mooncake()
    # client_ttl: how long the master lists a dead holder's values (so that a run sees them as lost)
    with LocalMooncake(segment_size=1 << 30, lease_ttl_ms=1000, client_ttl_s=60) as p:
        yield p


def test_restarted_supervisor_serves_the_trace_from_the_pool(tmp_path, pool):
    a_out, a, _ = run(tmp_path / "a", pool.url)
    b_out, b, _ = run(tmp_path / "b", pool.url, str(tmp_path / "a" / "workload.jsonl"))
    print("A", a["hit_ratio"], a["ttft_s"]["p50"], "B", b["hit_ratio"], b["ttft_s"]["p50"], b["storage_lookup"])
    assert b_out == a_out and len(a_out) == 64
    assert b["hit_ratio"]["storage"] >= 0.85, (a["hit_ratio"], b["hit_ratio"])
    assert b["ttft_s"]["p50"] <= 0.25 * a["ttft_s"]["p50"], (a["ttft_s"], b["ttft_s"])
    assert b["recomputed_because_storage"] == 0 and b["corrupt_values"] == 0 and b["storage_errors"] == 0, b


@pytest.mark.parametrize("tp", [1, 2])
def test_two_engines_at_once_share_the_pool(tmp_path, mooncake_url, tp):
    # a block loads only once every rank's shard of it is stored: at tp 2 give the other engine's
    # stores more time to land on a loaded machine before the later half asks for them
    a, b = two_engines_at_once(tmp_path, mooncake_url + f"&prefix={new_run_id()}", ("0", "0"), tp,
                               later_s=4.0 * tp)
    for s in (a, b):  # the later prefix was only ever computed by the other engine
        assert s["storage_lookup"]["keys_found"] > 0 and s["hit_ratio"]["storage"] > 0, s["storage_lookup"]
        assert s["corrupt_values"] == 0 and s["recomputed_because_storage"] == 0, s


def test_master_killed_mid_run(tmp_path, pool, reference):
    out = tmp_path / "run"
    proc = supervisor(out, pool.url, TRACE)
    kill_once_started(proc, out, pool.kill_master, after_s=3.0)  # the run takes ~15 s
    outputs, rep, stderr = finish(proc, out)
    assert outputs == reference
    assert rep["storage_errors"] > 0, rep
    # the lookups of the requests that arrived after the kill failed: not answered as all-miss
    assert rep["storage_lookup"]["failed"] > 0, rep["storage_lookup"]
    assert "failed during the run" in stderr, stderr[-2000:]  # shown to the user, not only in a log


def test_holder_killed_mid_run(tmp_path, pool, reference):
    run(tmp_path / "a", pool.url)  # fills the pool
    out = tmp_path / "b"
    proc = supervisor(out, pool.url, str(tmp_path / "a" / "workload.jsonl"))
    # once the start-up check wrote through the pool (a pool with no live holder fails it), before
    # B's first lookups
    kill_once_started(proc, out, pool.kill_holder, after_s=0.0, marker="logs/transfer0.log")
    outputs, rep, _ = finish(proc, out)
    assert outputs == reference
    # the values died with the holder, and the master still lists them: each load of one is a
    # miss, counted, and its tokens recomputed
    assert rep["storage_errors"] > 0 and rep["recomputed_because_storage"] > 0, rep

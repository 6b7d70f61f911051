"""Bad input through fastkv-supervisor: malformed workload lines stop the run before it starts
(rc 2, one line naming file:line and field); a request the engine can never run as asked is
rejected by itself, with its id and the reason, and the rest of the run goes on."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
# 8 device blocks of 4 tokens: max_model_len 32 tokens
SMALL = ["--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--block-size", "4", "--device-blocks", "8",
         "--host-blocks", "16", "--no-progress"]


def cli(tmp_path: Path, *argv: str, timeout: float = 150) -> tuple[int, str, str, float, str]:
    rid = f"t{uuid.uuid4().hex[:12]}"
    cmd = [sys.executable, "-m", "fastkv", "--out", str(tmp_path / "out"), "--run-id", rid, *argv]
    t0 = time.monotonic()
    done = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=timeout)
    return done.returncode, done.stdout, done.stderr, time.monotonic() - t0, rid


def request(rid: str, prompt: list, max_new: int = 4, arrival: object = 0) -> str:
    return json.dumps({"id": rid, "arrival_s": arrival, "prompt": prompt, "max_new_tokens": max_new})


@pytest.mark.parametrize("line, message", [
    ('{"id": "x", "arrival_s": NaN, "prompt": [1], "max_new_tokens": 1}',
     "request 'x': arrival_s must be a finite number >= 0, got nan"),
    ('{"id": "x", "arrival_s": Infinity, "prompt": [1], "max_new_tokens": 1}',
     "request 'x': arrival_s must be a finite number >= 0, got inf"),
    ('{"id": "x", "arrival_s": 0, "prompt": [1, 18446744073709551616], "max_new_tokens": 1}',
     "request 'x': prompt[1] = 18446744073709551616 is not a token id in [0, 1024) (the vocab of 1024)"),
    ('{"id": "x", "arrival_s": 0, "prompt": [true], "max_new_tokens": 1}',
     "request 'x': prompt[0] = true is not a token id in [0, 1024) (the vocab of 1024)"),
    ('{"id": "x", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1, "cache": {"read": ["gpu"]}}',
     "request 'x': cache.read: unknown tier 'gpu'; the tiers are device, host, storage"),
    ('{"id": "x", "arrival_s": 0, "prompt": [1], "max_new_tokens": 1, "cache": {"write": ["device"]}}',
     "request 'x': cache.write ['device']: a request writes every tier (the default) or none ([])"),
])
def test_malformed_workload_lines_stop_the_run_up_front(tmp_path, line, message):
    path = tmp_path / "w.jsonl"
    path.write_text(request("ok", [1, 2]) + "\n" + line + "\n")
    rc, out, err, seconds, rid = cli(tmp_path, "--workload", str(path), *SMALL)
    assert rc == 2 and err == f"fastkv-supervisor: error: {path}:2: {message}\n", err
    assert seconds < 10 and not out  # nothing started (generous: a loaded 2-core machine)
    assert not (tmp_path / "out" / "logs").exists() and not list(SHM.glob(f"fkv.{rid}.*"))


def test_requests_that_can_never_run_are_rejected_alone(tmp_path):
    path = tmp_path / "w.jsonl"
    path.write_text("\n".join([
        request("good-1", [5, 6, 7, 8, 9], max_new=6),
        request("too-long", list(range(1, 40))),  # 39 prompt tokens: more than the device holds
        request("good-2", [5, 6, 7, 11], max_new=8, arrival=0.05),
        request("huge-output", [1, 2, 3], max_new=10**9),  # refused, not cut to what fits and called "length"
        request("twenty", [1, 2, 3], max_new=30),  # 33 tokens: one more than fits
    ]) + "\n")
    rc, out, err, _, rid = cli(tmp_path, "--workload", str(path), *SMALL)
    assert rc == 0, err
    rows = {r["id"]: r for r in map(json.loads, (tmp_path / "out" / "results.jsonl").read_text().splitlines())}
    assert {k: r["finish"] for k, r in rows.items()} == {"good-1": "length", "good-2": "length", "too-long": "rejected",
                                                         "huge-output": "rejected", "twenty": "rejected"}
    assert [len(rows[k]["output"]) for k in ("good-1", "good-2")] == [6, 8]
    assert rows["too-long"]["reason"] == ("prompt 39 + max_new_tokens 4 = 43 tokens exceed max_model_len 32 "
                                          "(8 device blocks of 4 tokens)")
    assert rows["huge-output"]["reason"].startswith("prompt 3 + max_new_tokens 1000000000 = 1000000003 tokens")
    assert rows["twenty"]["output"] == [] and rows["good-1"]["reason"] == ""
    report = json.loads((tmp_path / "out" / "report.json").read_text())
    assert report["finish"] == {"length": 2, "rejected": 3} and set(report["rejected"]) == {"too-long", "huge-output",
                                                                                              "twenty"}
    assert "rejected                   too-long: prompt 39 + max_new_tokens 4 = 43 tokens exceed" in out
    assert not list(SHM.glob(f"fkv.{rid}.*"))


def test_the_trace_runs_with_its_defaults(tmp_path):
    rc, out, err, _, rid = cli(tmp_path, "--workload", "trace:12", "--no-progress")
    assert rc == 0, err
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == 12 and {r["finish"] for r in rows} == {"length"}
    spec = json.loads((tmp_path / "out" / "spec.json").read_text())
    longest = max(len(r["prompt"]) + r["max_new_tokens"] for r in
                  map(json.loads, (tmp_path / "out" / "workload.jsonl").read_text().splitlines()))
    beside = -(-2048 // 16)  # a step's token budget beside it: short prompts fit next to the longest
    assert spec["num_device_blocks"] == -(-longest // 16) + beside and "report:" in out
    assert not list(SHM.glob(f"fkv.{rid}.*"))

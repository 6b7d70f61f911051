"""bench_hybrid on a device tier small enough that memory binds: the group cache keeps more
requests in flight and generates faster than the all-full cache of the same bytes, and both
give the cache-free tokens (the script exits non-zero otherwise)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_groups_hold_more_requests_in_the_same_bytes_with_the_same_outputs(tmp_path):
    args = ["--requests", "10", "--prompt", "700", "--output", "40", "--device-gb", "0.1", "--chunk", "256",
            "--budget", "512", "--share", "5"]
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_hybrid.py"), *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["outputs_identical"] is True
    held, flight, rate = doc["kv_bytes_per_request"], doc["requests_in_flight"], doc["tokens_per_s"]
    assert held["hybrid"] < 0.6 * held["all_full"]
    assert flight["hybrid"] > 1.3 * flight["all_full"]
    assert rate["hybrid"] > rate["all_full"]

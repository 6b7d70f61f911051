"""Every benchmark refuses a bad flag in one last line naming it, without a traceback and before
it measures anything (a hostile-user sweep found counts of 0 or -1 read as the default or
crashing at the end, and missing files and servers ending in tracebacks)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("script", "args", "says"), [
    ("bench_cache.py", ["--trace", "no-such-trace.jsonl"], "--trace: trace file 'no-such-trace.jsonl' not found"),
    ("bench_cache.py", ["--requests", "-5"], "argument --requests: must be >= 1, got -5"),
    ("bench_cache.py", ["--repeat", "0"], "argument --repeat: must be >= 1, got 0"),
    ("bench_e2e.py", ["--rounds", "-1"], "argument --rounds: must be >= 0, got -1"),
    ("bench_e2e.py", ["--copy-gbps", "-3"], "argument --copy-gbps: must be >= 0.0, got -3"),
    ("bench_e2e.py", ["--entry", "nonsense"], "--entry must be ROLE=MODULE:FUNC"),
    ("bench_hits.py", ["--repeats", "0"], "argument --repeats: must be >= 1, got 0"),
    ("bench_hits.py", ["--copy-gbps", "-1"], "argument --copy-gbps: must be >= 0.0, got -1"),
    ("bench_hybrid.py", ["--requests", "0"], "argument --requests: must be >= 1, got 0"),
    ("bench_hybrid.py", ["--device-gb", "-1"], "argument --device-gb: must be >= 0.001, got -1"),
    ("bench_hybrid.py", ["--device-gb", "0.01"], "cannot hold one request of 612 tokens"),
    ("bench_lmdb_stall.py", ["--rounds", "-2"], "argument --rounds: must be >= 0, got -2"),
    ("bench_storage.py", ["--blocks", "0"], "argument --blocks: must be >= 1, got 0"),
    ("bench_storage.py", ["--tmpdir", "no-such-dir/deeper"], "--tmpdir: [Errno 2] No such file or directory"),
    ("bench_storage.py", ["--backends", "redis", "--redis-url", "redis://127.0.0.1:1"],
     "backend redis at 'redis://127.0.0.1:1': put failed"),
    ("bench_swap.py", ["--blocks", "0"], "argument --blocks: must be >= 1, got 0"),
    ("bench_swap.py", ["--rtt-reps", "0"], "argument --rtt-reps: must be >= 1, got 0"),
    ("bench_write_through.py", ["--contexts", "1,x"], "--contexts must be integers separated by commas"),
])
def test_a_bad_flag_is_one_line_naming_it(script, args, says, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--smoke", *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0, proc.stdout[-2000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert says in proc.stderr.strip().splitlines()[-1], proc.stderr[-2000:]
    assert not proc.stdout.strip().endswith("}"), "it measured and printed its JSON line"

"""bench_e2e refuses bad settings in one line naming them, before it runs anything."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("args", "says"), [
    (["--dtype", "bf16"], "got 'bf16'"),
    (["--layers", "0"], "setting 'layers' must be >= 1, got 0"),
    (["--workload", "no-such-file.jsonl"], "workload file 'no-such-file.jsonl' not found"),
])
def test_a_bad_setting_is_one_line_naming_it(args, says, tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--smoke", "--copy-gbps", "10",
                           "--out", str(tmp_path / "out"), *args], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith("bench_e2e: ") and says in lines[-1], proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())

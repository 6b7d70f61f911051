"""scripts/restart_hog.py (the restart pair beside busy processes) runs and ends with its JSON
line; a smoke run's figures mean nothing and are not checked, only that B asked the pool."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_smoke_run_ends_with_its_json_line(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "restart_hog.py"), "--smoke", "--hogs", "1"],
                          cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                          timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["bench"] == "restart_hog" and got["requests"] == 4 and got["hogs"] == 1
    assert set(got) >= {"ttft_p50_s", "storage_hit_ratio", "ttft_p50_ratio", "a_skipped_by", "b_lookup", "goals_met"}
    assert got["b_lookup"]["keys_asked"] > 0 and got["a_stored"] > 0, got

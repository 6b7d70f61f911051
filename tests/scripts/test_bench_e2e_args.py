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
    (["--storage", "none"], "run 'storage': preemption 'storage' needs a storage tier"),  # not a traceback
    (["--kv-cache-dtype", "fp8_e4m3", "--dtype", "float16"], "as --dtype or as --kv-cache-dtype, not both"),
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


def _bench_e2e():
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_e2e", ROOT / "scripts" / "bench_e2e.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_under_a_cost_model_every_workload_has_32_kib_of_kv_per_token():
    from fastkv.cli import JobConfig

    b = _bench_e2e()
    for workload in ("demo", "trace:8", "mixed"):
        d = b.run_defaults(workload, modelled=True)
        layout = JobConfig(layers=d["layers"], kv_heads=d["kv_heads"], dtype=d["dtype"]).layout()
        assert layout.block_bytes // layout.block_size == 32 << 10, workload
    flat = b.run_defaults("demo", modelled=False)  # the flat cost is per token: the supervisor's layout
    assert {k: flat[k] for k in ("layers", "kv_heads", "dtype", "host_blocks")} == {
        k: getattr(JobConfig, k) for k in ("layers", "kv_heads", "dtype", "host_blocks")}
    assert b.run_defaults("mixed", modelled=False)["device_blocks"] == b.MIXED["device_blocks"]


def test_verify_with_a_runner_that_has_no_byte_checks_is_refused(tmp_path):
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / "bench_e2e.py"), "--smoke", "--runner", "tiny",
                           "--verify", "off", "--out", str(tmp_path / "out")], cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--verify is the synthetic runner's" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "out").exists()

"""Python started in the directory above a checkout named ``fastkv``: without an installed
fastkv winning, ``fastkv.ops`` would be the C-source folder ops/ and a process would die later
on a missing attribute; it fails at the import with one line naming the cause instead."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import fastkv.ops as o; print(o.default_fatal_signals.__module__, o.__file__)"


def _python(cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_started_above_a_checkout_named_fastkv_fails_with_one_line(tmp_path):
    (tmp_path / "fastkv").symlink_to(ROOT, target_is_directory=True)
    got = _python(tmp_path, None)
    if got.returncode == 0:  # an installed fastkv on a plain sys.path entry won over the namespace
        assert "/ops.py" in got.stdout, got.stdout
        return
    last = got.stderr.strip().splitlines()[-1]
    assert last.startswith("ImportError: fastkv: Python took the source checkout"), got.stderr[-2000:]
    assert f"started in {tmp_path.resolve()}" in last and "AttributeError" not in got.stderr


def test_the_package_on_pythonpath_wins_over_the_checkout_root(tmp_path):
    (tmp_path / "fastkv").symlink_to(ROOT, target_is_directory=True)
    got = _python(tmp_path, str(ROOT))
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["fastkv.ops", str(ROOT / "fastkv" / "ops.py")]

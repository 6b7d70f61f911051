"""Python started in the directory above a checkout named ``fastkv`` takes the checkout's root
for the package (a namespace package: the root has no ``__init__.py``). A folder at the root
named like one of fastkv's modules (``ops/``, the C sources, was one) would then be imported in
its place and a process would die later on a missing attribute; with no such name the import
fails at once, naming the module."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PROBE = "import fastkv.kernels.ops as o; print(o.default_fatal_signals.__module__, o.__file__)"


def _python(cwd: Path, pythonpath: str | None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    if pythonpath is not None:
        env["PYTHONPATH"] = pythonpath
    return subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=60)


def test_no_folder_at_the_root_is_named_like_a_module_of_fastkv():
    modules = {p.stem for p in (ROOT / "fastkv").iterdir() if p.suffix == ".py" or (p / "__init__.py").is_file()}
    at_root = {p.name for p in ROOT.iterdir() if not p.name.startswith(".")}
    assert sorted(modules & at_root) == []


def test_started_above_a_checkout_named_fastkv_fails_at_the_import(tmp_path):
    (tmp_path / "fastkv").symlink_to(ROOT, target_is_directory=True)
    got = _python(tmp_path, None)
    if got.returncode == 0:  # an installed fastkv on a plain sys.path entry won over the namespace
        assert got.stdout.split()[1].endswith("/kernels/ops.py"), got.stdout
        return
    last = got.stderr.strip().splitlines()[-1]
    assert last == "ModuleNotFoundError: No module named 'fastkv.kernels'", got.stderr[-2000:]


def test_the_package_on_pythonpath_wins_over_the_checkout_root(tmp_path):
    (tmp_path / "fastkv").symlink_to(ROOT, target_is_directory=True)
    got = _python(tmp_path, str(ROOT))
    assert got.returncode == 0, got.stderr[-2000:]
    assert got.stdout.split() == ["fastkv.kernels.ops", str(ROOT / "fastkv" / "kernels" / "ops.py")]

"""Every module imports on its own, first, in a fresh interpreter (no import cycles that only
a lucky import order hides), and ``import fastkv`` pulls in neither Paddle nor the engine."""
import importlib.util
import pkgutil
import subprocess
import sys

import pytest

import fastkv

# Modules of an optional extra, checked only where the extra is installed.
EXTRAS = {f"fastkv.engine.runners.paddleformers.{m}": "paddleformers"
          for m in ("runner", "llama", "ernie4_5", "gemma3", "gpt_oss")}
MODULES = sorted(m.name for m in pkgutil.walk_packages(fastkv.__path__, "fastkv.")
                 if not m.name.startswith(("fastkv._", "fastkv.kernels.ops"))
                 and (m.name not in EXTRAS or importlib.util.find_spec(EXTRAS[m.name]) is not None))


def test_every_module_imports_first_in_a_fresh_interpreter():
    code = ("import subprocess, sys\n"
            "bad = []\n"
            f"for m in {MODULES!r}:\n"
            "    r = subprocess.run([sys.executable, '-c', f'import {m}'], capture_output=True, text=True)\n"
            "    if r.returncode:\n"
            "        bad.append((m, r.stderr.strip().splitlines()[-1]))\n"
            "print(bad)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


@pytest.mark.parametrize("name", ["Engine", "EngineError", "RequestResult"])
def test_engine_exports_resolve(name):
    import fastkv.engine

    assert getattr(fastkv.engine, name).__module__ == "fastkv.engine.core"
    with pytest.raises(AttributeError, match="no attribute"):
        fastkv.engine.NoSuchThing  # noqa: B018

"""The README's embedding snippet against the code: it compiles, and every method it calls on the
engine, the worker port, the launched run, a plan and an update exists (the runnable version,
tests/e2e/embed_example.py, is run as written by tests/e2e/test_launch.py)."""
from __future__ import annotations

import ast
import re
from pathlib import Path

from fastkv.engine import Engine, StepUpdate
from fastkv.engine.worker_api import Plan, WorkerPort
from fastkv.launch import Launch

ROOT = Path(__file__).resolve().parents[2]
OWNERS = {"engine": Engine, "port": WorkerPort, "run": Launch, "plan": Plan, "update": StepUpdate}


def _snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Embedding fastkv in a Paddle deployment", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_embedding_snippet_uses_only_what_exists():
    tree = ast.parse(_snippet())
    used = {(n.value.id, n.attr) for n in ast.walk(tree)
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name) and n.value.id in OWNERS}
    assert len(used) >= 10, used
    missing = [f"{name}.{attr}" for name, attr in sorted(used)
               if not hasattr(OWNERS[name], attr) and attr not in getattr(OWNERS[name], "_fields", ())]
    assert not missing, f"README.md's embedding example calls what does not exist: {missing}"


def test_the_example_file_it_points_to_exists():
    assert "tests/e2e/embed_example.py" in (ROOT / "README.md").read_text()
    assert (ROOT / "tests/e2e/embed_example.py").is_file()


def test_worker_api_documents_every_call_a_deployment_makes():
    """WORKER_API.md names every public method of the worker port and of the engine's embedding
    surface (the engine process's own helpers aside)."""
    doc = (ROOT / "docs" / "WORKER_API.md").read_text()
    engine_own = {"rejected", "check_workers"}  # fastkv's engine process reports with these
    calls = [(cls.__name__, name) for cls in (WorkerPort, Engine) for name, value in vars(cls).items()
             if callable(value) and not name.startswith("_") and (cls, name) not in {(Engine, n) for n in engine_own}]
    assert len(calls) > 20, calls
    missing = [f"{owner}.{name}" for owner, name in calls if f"{name}(" not in doc]
    assert not missing, f"docs/WORKER_API.md does not document: {missing}"
    for name in ("stop", "start", "start_transfers"):
        assert f"run.{name}(" in doc, name

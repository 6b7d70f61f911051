"""Every scripts/bench_*.py runs in its ``--smoke`` mode and ends with its JSON line, keyed as
BENCHMARKS.md shows it (other tools read those keys): a broken script or a renamed key fails
here. The numbers of a smoke run mean nothing and are not checked."""
from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = sorted(p.name for p in (ROOT / "scripts").glob("bench_*.py"))


def documented() -> dict[str, dict]:
    """The JSON line of each benchmark in BENCHMARKS.md (the first line starting ``{"bench": `` per bench)."""
    out: dict[str, dict] = {}
    for line in (ROOT / "BENCHMARKS.md").read_text().splitlines():
        if line.startswith('{"bench": '):
            doc = json.loads(line)
            out.setdefault(doc["bench"], doc)
    return out


def shape(doc: dict) -> dict[str, set[str] | None]:
    return {k: set(v) if isinstance(v, dict) else None for k, v in doc.items()}


def numbers(doc: dict) -> list:
    """Every non-string leaf, nested objects included (bench_e2e's ``verified`` holds one per run)."""
    return [x for v in doc.values() for x in (numbers(v) if isinstance(v, dict) else [v]) if not isinstance(x, str)]


def run_smoke(script: str, *args: str, tmp_path: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--smoke", *args], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, f"{script} --smoke exited {proc.returncode}:\n{proc.stderr[-3000:]}"
    last = proc.stdout.strip().splitlines()[-1]
    return json.loads(last)


def tiny_trace(path: Path) -> Path:
    """60 requests in the Mooncake trace's format, sharing prefixes (so that there are hits)."""
    with path.open("w") as f:
        for i in range(60):
            ids = [0, 1, 2][: 1 + i % 3] + [100 + i * 4 + j for j in range(1 + i % 4)]
            f.write(json.dumps({"timestamp": i, "input_length": 512 * len(ids) - 7, "output_length": 8,
                                "hash_ids": ids}) + "\n")
    return path


def extra_args(script: str, tmp_path: Path) -> list[str]:
    if script == "bench_cache.py":  # not the real trace beside the checkout: the tests read nothing outside it
        return ["--trace", str(tiny_trace(tmp_path / "trace.jsonl"))]
    if script == "bench_storage.py":
        from tests.storage.conftest import require_redis

        require_redis()  # skips locally, fails in CI, as the storage tests do
    return []


# > 10 s on a loaded 2-core machine
SLOW = {"bench_ipc.py", "bench_e2e.py", "bench_swap.py", "bench_pool.py", "bench_hits.py", "bench_layerwise.py"}


def test_every_script_is_covered():
    assert SCRIPTS and set(SCRIPTS) >= SLOW
    assert {s.removeprefix("bench_").removesuffix(".py") for s in SCRIPTS} == set(documented())


@pytest.mark.parametrize("script", [pytest.param(s, marks=[pytest.mark.slow] if s in SLOW else []) for s in SCRIPTS])
def test_smoke_run_ends_with_the_documented_json(script, tmp_path):
    bench = re.fullmatch(r"bench_(\w+)\.py", script).group(1)
    want = documented()[bench]
    got = run_smoke(script, *extra_args(script, tmp_path), tmp_path=tmp_path)
    assert got["bench"] == bench
    have, need = shape(got), shape(want)
    assert set(have) == set(need), f"{script}: top-level keys {sorted(have)} != BENCHMARKS.md's {sorted(need)}"
    for key, sub in need.items():
        assert (sub is None) == (have[key] is None), f"{script}: {key} changed between a value and an object"
        assert sub is None or sub <= have[key], f"{script}: {key} lacks {sorted(sub - have[key])}"
    for x in numbers(got):
        assert isinstance(x, bool | int | float) and (isinstance(x, bool) or math.isfinite(x)), (script, got)

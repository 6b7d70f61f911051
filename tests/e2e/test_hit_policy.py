"""The hit policy and the prefetch policy through the supervisor: a restart on a pool behind 10 GbE
recomputes what loading would deliver later, with the same outputs as loading it."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.e2e.test_storage_pool import RESTART_SHAPE, ROOT


def supervise(tmp_path, name: str, url: str, workload, *flags: str) -> tuple[dict[str, list[int]], dict]:
    out = tmp_path / name
    cmd = [sys.executable, "-m", "fastkv", "--no-progress", "--out", str(out), "--storage", url,
           "--workload", str(workload), "--config", str(tmp_path / "pool10g.toml"), *RESTART_SHAPE, *flags]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, f"run {name} failed:\n{proc.stdout}\n{proc.stderr}"
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return {r["id"]: r["output"] for r in rows}, json.loads((out / "summary.json").read_text())


@pytest.mark.slow
def test_a_restart_on_a_10gbe_pool_recomputes_its_hits_with_the_same_outputs(tmp_path):
    (tmp_path / "pool10g.toml").write_text('[runner_options]\ncost_model = "llama3-8b-h100-sxm-pool10g"\n'
                                           'copy_gbps = 10.0\n')
    wl = tmp_path / "wl.jsonl"
    wl.write_text("".join(json.dumps({"id": f"r{i}", "arrival_s": 0, "max_new_tokens": 4,
                                      "prompt": [(i * 131 + j * 17) % 1000 for j in range(320 + i)]}) + "\n"
                          for i in range(16)))
    url = f"lmdb://{tmp_path}/store"
    a_out, _ = supervise(tmp_path, "a", url, wl, "--storage-backlog-blocks", "100000")
    wl_a = tmp_path / "a" / "workload.jsonl"
    auto_out, auto = supervise(tmp_path, "auto", url, wl_a)
    load_out, load = supervise(tmp_path, "load", url, wl_a, "--hit-policy", "load", "--prefetch-policy",
                               "wait_complete")
    assert auto_out == a_out == load_out and len(a_out) == 16
    h = auto["hits"]
    assert h["policy"] == "auto" and h["costed"] and h["decisions"] > 0, h
    assert h["recomputed_tokens"]["storage"] > 2 * h["loaded_tokens"]["storage"], h
    assert load["hits"]["recomputed_tokens"] == {"host": 0, "storage": 0}, load["hits"]
    assert load["hits"]["loaded_tokens"]["storage"] > 0 and load["storage_lookup"]["timed_out"] == 0, load
    assert auto["hit_ratio"]["storage"] < load["hit_ratio"]["storage"]

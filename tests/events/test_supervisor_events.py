# ruff: noqa: E402  (the imports below need the extra checked first)
"""The supervisor's --quick demo with KV events on and a weight update: a subscriber in another
process applies every batch and ends with the engine's keys per tier (the summary's digest of
what its residency log announced)."""
from __future__ import annotations

from tests.optional import require_events, require_paddle

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastkv.events import resident_digest
from fastkv.routing.indexer import Indexer
from tests.events import spec_keys

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]


def test_quick_demo_events_reach_a_subscriber_in_another_process(tmp_path):
    require_paddle()
    pub = f"ipc://{tmp_path}/kv-events"
    idx = Indexer()
    view = idx.add("engine", pub, topic="kv@")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(tmp_path / "out"),
           "--kv-events-endpoint", pub, "--kv-events-topic", "kv@pod-0@fastkv-demo", "--update-weights-at", "10:v2"]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            idx.poll(0.2)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err
        idx.poll(1.0)
        summary = json.loads((tmp_path / "out" / "summary.json").read_text())
        ev = summary["kv_events"]
        assert ev["dropped"] == 0 and ev["batches"] > 100
        # the subscriber connected before the engine started: nothing to replay
        assert view.gaps == 0 and view.next_seq == view.batches == ev["batches"]
        assert view.clears >= 1  # the weight update
        # the summary's digests are of the tiers' own maps at the end, not of what the events announced
        for medium, want in ev["resident"].items():
            assert resident_digest(view.held.get(medium, set())) == want, medium
        assert ev["resident"]["GPU"]["keys"] > 0 and ev["resident"]["CPU"]["keys"] > 0
        # and every key held is a chained key of a request's tokens under the final namespace
        # (the update cleared the tiers), computed by the key spec (spec_keys), not by fastkv
        out_dir = tmp_path / "out"
        prompts = {d["id"]: d["prompt"] for d in map(json.loads, (out_dir / "workload.jsonl").read_text().splitlines())}
        block_size = json.loads((out_dir / "spec.json").read_text())["layout"]["block_size"]
        chained = set()
        for row in map(json.loads, (out_dir / "results.jsonl").read_text().splitlines()):
            chained.update(spec_keys.chain(prompts[row["id"]] + row["output"], bytes.fromhex(ev["namespace"]),
                                           block_size))
        for medium, keys in view.held.items():
            assert keys <= chained, f"{medium}: {len(keys - chained)} keys of no request's tokens"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        idx.close()

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
        ev = json.loads((tmp_path / "out" / "summary.json").read_text())["kv_events"]
        assert ev["dropped"] == 0 and ev["batches"] > 100
        # the subscriber connected before the engine started: nothing to replay
        assert view.gaps == 0 and view.next_seq == view.batches == ev["batches"]
        assert view.clears >= 1  # the weight update
        for medium, want in ev["resident"].items():
            assert resident_digest(view.held.get(medium, set())) == want, medium
        assert ev["resident"]["GPU"]["keys"] > 0 and ev["resident"]["CPU"]["keys"] > 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        idx.close()

# ruff: noqa: E402  (the imports below need the extra checked first)
"""``fastkv --quick --kv-events-schema NAME``: a subscriber decoding with that schema's consumer's
own structs (tests/events/consumers.py) reads every batch of a whole supervised run, and its key
sets give the summary's ``kv_events`` figures by docs/FORMATS.md's definitions."""

from tests.optional import require_events, require_paddle

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import json
import os
import subprocess
import sys
from pathlib import Path

import blake3
import pytest
import zmq

from tests.events.consumers import CONSUMERS, READS, apply_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
ROOT = Path(__file__).resolve().parents[2]
MEDIA = ("GPU", "CPU", "DISK")


@pytest.mark.parametrize("name", ["llm-d", "vllm-array", "vllm"])
def test_a_supervised_run_in_each_schema_is_read_by_its_consumer(tmp_path, name):
    require_paddle()  # the supervisor runs the ops: the cpu extra
    consumer = sorted(c for c in READS[name] if c != "llm-d")[0]  # unfolded keys, for the digest
    pub = f"ipc://{tmp_path}/kv-events"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(pub)
    frames: list[list[bytes]] = []
    cmd = [sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(tmp_path / "out"),
           "--kv-events-endpoint", pub, "--kv-events-schema", name, "--update-weights-at", "10:v2"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        while proc.poll() is None:
            if sub.poll(200):
                frames.append(sub.recv_multipart())
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        while sub.poll(1000):
            frames.append(sub.recv_multipart())
        ev = json.loads((tmp_path / "out" / "summary.json").read_text())["kv_events"]
        # the subscriber connected before the engine started: every batch arrives live, in order
        assert [int.from_bytes(f[1], "big") for f in frames] == list(range(ev["batches"]))
        held: dict[str, set] = {m: set() for m in MEDIA}
        events = 0
        for _, _, payload in frames:
            for decode in (CONSUMERS[c] for c in READS[name]):
                decode(payload)  # every consumer of this schema reads every batch
            _, batch = CONSUMERS[consumer](payload)
            events += len(batch)
            apply_batch(held, batch)
        assert events == ev["events"]
        digest = {m: blake3.blake3(b"".join(sorted(held[m]))).hexdigest() for m in MEDIA}
        assert ev["resident"] == {m: {"keys": len(held[m]), "digest": digest[m]} for m in MEDIA}
        assert held["GPU"] and held["CPU"]
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ctx.destroy(linger=0)

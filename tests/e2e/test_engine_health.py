"""The engine's public health surface (docs/WORKER_API.md, "Health"): ``health()`` accounts for every
block and request, its counters are summary.json's, and ``check()`` raises on a broken invariant;
a storage preemption without a storage tier is refused where it is asked for."""
from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest

from fastkv.config import KVLayout
from fastkv.engine import Engine, RequestRejected
from fastkv.engine.health import counters
from fastkv.launch import launch
from fastkv.run import RunSpec
from tests.e2e.embed_example import WORKER

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _spec(tmp_path, **kw) -> RunSpec:
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32")
    return RunSpec(f"hl{uuid.uuid4().hex[:8]}", layout, 16, 32, out_dir=str(tmp_path), heartbeat_s=0.2, **kw)


@contextmanager
def _engine(spec: RunSpec) -> Iterator[Engine]:
    """An engine on a launched run of the toy worker, closed after the block."""
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            yield engine
        finally:
            engine.close()


def test_health_accounts_for_every_block_and_request_and_check_catches_a_broken_pool(tmp_path):
    spec = _spec(tmp_path)
    with _engine(spec) as engine:
        engine.wait_until_ready(60)
        for i in range(6):
            engine.add_request([i + 1] * 9, 12, request_id=f"h{i}", preemption="offload")
        seen_running, results = 0, []
        while engine.has_work():
            results += engine.step()
            h = engine.health()
            for tier, n in (("device", spec.num_device_blocks), ("host", spec.num_host_blocks)):
                assert sum(h["blocks"][tier].values()) == n, h["blocks"]
            unfinished = 6 - len(results)
            assert sum(h["requests"].values()) == unfinished, (h["requests"], unfinished)
            seen_running = max(seen_running, h["requests"]["running"])
            engine.check()
        h = engine.health()
        assert seen_running > 0 and h["copies_in_flight"] == 0
        assert h["blocks"]["device"]["allocated"] == 0 and h["blocks"]["device"]["in_flight"] == 0
        assert h["counters"]["preemptions"]["offload"] == sum(r.preemptions for r in results) > 0
        assert h["counters"] == counters(engine) and h["weights_version"] == "0"
        device = engine.cache.device
        free = next(b for b in range(spec.num_device_blocks) if device.ref[b] == 0)
        device.ref[free] = 1  # a block held by nobody
        with pytest.raises(AssertionError):
            engine.check()
        device.ref[free] = 0
        engine.check()


def test_storage_preemption_without_a_storage_tier_is_refused(tmp_path):
    spec = _spec(tmp_path)
    with _engine(spec) as engine:
        with pytest.raises(RequestRejected, match="preemption 'storage' needs a storage tier"):
            engine.add_request([1, 2, 3], 4, request_id="s0", preemption="storage")
        assert engine.add_request([1, 2, 3], 4, request_id="s1", preemption="offload") == "s1"
    bad = _spec(tmp_path, scheduler={"preemption": "storage"})
    with launch(bad), pytest.raises(ValueError, match="preemption 'storage' needs a storage tier"):
        Engine.attach(bad)

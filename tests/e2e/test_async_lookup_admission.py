"""Async scheduling with a storage tier: a request that arrives while a step runs is parked for
its storage lookup; the engine waits for the answer while that step is still in flight, so the
request joins the very next plan (a step earlier than when the plan went out without it)."""
from __future__ import annotations

import time
import uuid

from fastkv.config import KVLayout
from fastkv.engine import Engine
from fastkv.launch import launch
from fastkv.run import RunSpec

STEP_S = 0.25  # each toy step's extra time: a lookup's round trip is milliseconds
WORKER = f"{__name__}:slow_worker"


def slow_worker(spec_json: str, rank: int) -> int:
    """The README's toy worker, each step STEP_S slower (a model step that takes a while)."""
    from tests.e2e import embed_example as ex

    fast = ex.toy_step

    def slow(*args, **kw):
        time.sleep(STEP_S)
        return fast(*args, **kw)

    ex.toy_step = slow
    return ex.worker_main(spec_json, rank)


def steps_to_first_token(tmp_path, async_on: bool) -> tuple[int, int]:
    """(step_stream calls from a request's arrival until its first token, lookups timed out)."""
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32")
    spec = RunSpec(f"alk{uuid.uuid4().hex[:8]}", layout, 64, 64, out_dir=str(tmp_path / f"a{async_on}"),
                   storage_url=f"lmdb://{tmp_path}/store-{async_on}?max_bytes=64M", heartbeat_s=0.2,
                   async_scheduling=async_on)
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready()
            engine.add_request(list(range(1, 9)), 40, request_id="running")
            for _ in range(3):  # its prefill and a few decodes: steps now go out back to back
                engine.step_stream()
            engine.add_request(list(range(100, 140)), 4, request_id="late")  # 10 blocks to look up
            n = 0
            while True:
                n += 1
                if "late" in engine.step_stream().tokens:
                    break
                assert n < 10, "the late request never sampled"
            timed_out = engine.lookups.stats.timed_out
            while engine.has_work():
                engine.step_stream()
        finally:
            engine.close()
    return n, timed_out


def test_a_request_arriving_mid_step_joins_the_next_plan(tmp_path):
    n_async, timed_out = steps_to_first_token(tmp_path, True)
    assert timed_out == 0
    # the plan sent in the first call carries its prefill; its output is applied in the second
    assert n_async == 2, f"first token after {n_async} engine steps"
    n_sync, _ = steps_to_first_token(tmp_path, False)
    # synchronous: the first call plans before the answer (the scheduler never waits), the second
    # carries it and runs it at once: async admits as soon as sync does
    assert n_sync == 2, f"first token after {n_sync} engine steps (sync)"

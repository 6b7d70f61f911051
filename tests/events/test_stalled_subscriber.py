# ruff: noqa: E402  (the imports below need the extra checked first)
"""A subscriber that never reads: the publisher counts the batches it could not take (summary
and metrics), memory stays bounded, a healthy subscriber beside it loses nothing for good, and
a subscriber that joins later replays and ends with the engine's index."""
from __future__ import annotations

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import threading
import time

import zmq
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fastkv.engine.metrics import EngineMetrics
from fastkv.events import EventsConfig
from fastkv.events.publisher import ZmqPublisher
from fastkv.routing.indexer import Indexer
from tests.events.demo_rig import run_demo
from tests.events.test_events_mirror import assert_same
from tests.events.test_wire import public_schema

N, LIVE = 1500, 100  # batches published; keys held at the end (each batch stores one, removes the one LIVE back)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def stalled_sub(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 4
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)  # and never reads
    return sub


def test_a_stalled_subscriber_is_counted_and_set_aside_while_a_healthy_one_stays_exact(tmp_path):
    cfg = EventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                       hwm=8, buffer_steps=1000, stall_timeout_ms=300)
    EventBatch, BlockStored, BlockRemoved, _ = public_schema(True)
    tokens = [1 << 30] * 2000  # a batch of some 10 KB: the stalled one's socket buffers fill soon
    ctx = zmq.Context()
    pub = ZmqPublisher(cfg)
    idx = Indexer()
    try:
        stalled = stalled_sub(ctx, cfg.endpoint)  # noqa: F841 (held open, never read)
        healthy = idx.add("e", cfg.endpoint, cfg.replay_endpoint)
        time.sleep(0.2)  # both connections are up before the first batch
        handoff = 0.0
        for i in range(N):
            events = [BlockStored([key(i)], None, tokens, 2000, None, "GPU")]
            if i >= LIVE:
                events.append(BlockRemoved([key(i - LIVE)], "GPU"))
            t0 = time.perf_counter()
            pub.publish(EventBatch(0.0, events, 0))
            handoff = max(handoff, time.perf_counter() - t0)
            if i % 10 == 9:
                time.sleep(0.005)  # steps take time: the stall outlasts stall_timeout_ms
                idx.poll(0)
        assert pub.sync(10.0)
        assert handoff < 0.05, f"publish waited {handoff * 1e3:.1f} ms for a subscriber"
        # counted at the publisher; the stalled one was set aside and the rest went out live
        assert 0 < pub.dropped < N - 200 and pub.set_aside >= 1, (pub.dropped, pub.set_aside)
        assert len(pub.buffer) == cfg.buffer_steps  # memory: the replay buffer is bounded
        idx.sync()
        want = {key(i) for i in range(N - LIVE, N)}
        assert healthy.next_seq == N and healthy.lost == 0 and healthy.gaps >= 1, healthy
        assert healthy.held["GPU"] == want
        late = Indexer()  # joins after the stall: what it missed comes from the replay buffer
        try:
            view = late.add("e", cfg.endpoint, cfg.replay_endpoint)
            late.sync()
            assert view.next_seq == N and view.lost == N - cfg.buffer_steps and view.held["GPU"] == want
        finally:
            late.close()
    finally:
        pub.close()
        idx.close()
        ctx.destroy(linger=0)


def test_the_demo_beside_a_subscriber_that_never_reads_counts_drops_in_metrics_and_replays_exact(tmp_path):
    cfg = EventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                       hwm=4, buffer_steps=100_000, stall_timeout_ms=600_000)  # never set aside here
    ctx = zmq.Context()
    stalled = stalled_sub(ctx, cfg.endpoint)  # noqa: F841 (held open, never read)
    metrics = []

    def on_step(step, rig, ev):
        if not metrics:
            metrics.append(EngineMetrics(rig.sched))
            metrics[0].events = ev

    rig, ev = run_demo(cfg, on_step)
    idx = Indexer()
    try:
        assert ev.sync(10.0)
        st = ev.stats()
        assert st["dropped"] > st["batches"] // 2, st  # its queue filled early: nobody got the rest live
        assert st["buffered"] == st["batches"] and st["set_aside"] == 0
        text = generate_latest(metrics[0].registry).decode()
        got = {s.labels["outcome"]: s.value for fam in text_string_to_metric_families(text) for s in fam.samples
               if s.name == "fastkv_kv_event_batches_total"}
        assert got == {"published": st["batches"], "dropped": st["dropped"]}
        view = idx.add("e0", cfg.endpoint, cfg.replay_endpoint)
        idx.sync()  # a new subscriber: everything from the replay buffer
        assert view.next_seq == st["batches"]
        assert_same(view, rig, "replayed beside a stalled subscriber")
    finally:
        ev.close()
        idx.close()
        ctx.destroy(linger=0)


def test_a_batch_that_fails_to_build_is_counted_and_the_publisher_goes_on(tmp_path):
    EventBatch, BlockStored, *_ = public_schema(True)
    pub = ZmqPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub"))
    try:
        def broken():
            raise RuntimeError("a bug")

        pub.publish(broken)
        pub.publish(lambda: EventBatch(0.0, [BlockStored([key(1)], None, [0], 1, None, "GPU")], 0))
        assert pub.sync(10.0)
        assert pub.errors == 1 and [s for s, _ in pub.buffer] == [1]
    finally:
        pub.close()


def test_the_engine_waits_for_its_encoder_only_past_queue_batches(tmp_path, monkeypatch):
    import fastkv.events.publisher as publisher

    monkeypatch.setattr(publisher, "QUEUE_BATCHES", 2)
    EventBatch, BlockStored, *_ = public_schema(True)
    batch = EventBatch(0.0, [BlockStored([key(1)], None, [0], 1, None, "GPU")], 0)
    gate = threading.Event()
    pub = ZmqPublisher(EventsConfig(endpoint=f"ipc://{tmp_path}/pub"))
    try:
        pub.publish(lambda: batch if gate.wait(30) else None)  # the encoder is busy with this one
        pub.publish(batch)  # two handed over: no wait yet
        third = threading.Thread(target=pub.publish, args=(batch,))
        third.start()
        third.join(0.3)
        assert third.is_alive(), "a third batch went in with two still unencoded"
        gate.set()
        third.join(30)
        assert not third.is_alive() and pub.sync(10.0)
        assert [s for s, _ in pub.buffer] == [0, 1, 2] and pub.errors == 0
    finally:
        gate.set()
        pub.close()

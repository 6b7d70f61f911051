# ruff: noqa: E402  (the imports below need the extra checked first)
"""A subscriber that applies the KV events has the engine's own index, per tier, key by key:
at sampled steps of the --quick demo (offload pressure, copies in flight across steps, a
weight update and a reset_prefix_cache) and at its end, also when it replays every batch from
the start; and one killed mid-run (closed in-process, or its process killed) and replaced sees
the gap, replays, and ends exact."""
from __future__ import annotations

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from fastkv.events import EventsConfig
from fastkv.routing.indexer import Indexer
from tests.events.demo_rig import chained_keys, engine_index, run_demo

SAMPLE_EVERY = 40
ROOT = Path(__file__).resolve().parents[2]


def config(tmp_path, **kw) -> EventsConfig:
    return EventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                        buffer_steps=100_000, **kw)


def assert_same(view, rig, when: str) -> None:
    want = engine_index(rig)
    for medium, keys in want.items():
        got = view.held.get(medium, set())
        assert got == keys, (f"{when}: {medium} subscriber has {len(got)} keys, engine {len(keys)}: "
                             f"{len(got - keys)} extra, {len(keys - got)} missing")
    assert view.lost == 0


def test_live_and_replaying_subscribers_match_the_engine_per_tier(tmp_path):
    cfg = config(tmp_path)
    idx = Indexer()
    live = idx.add("e0", cfg.endpoint, cfg.replay_endpoint, topic="kv@")
    samples, replayed = [], []

    def on_step(step, rig, ev):
        idx.poll(0)
        if step % SAMPLE_EVERY == 0:
            idx.sync()
            assert_same(live, rig, f"step {step}")
            samples.append(sum(len(k) for k in live.held.values()))
        if step % (4 * SAMPLE_EVERY) == 2 * SAMPLE_EVERY:  # a subscriber joining now replays from seq 0
            fresh = Indexer()
            try:
                view = fresh.add("e0", cfg.endpoint, cfg.replay_endpoint, topic="kv@")
                fresh.sync()
                assert view.next_seq == ev.publisher.seq
                assert_same(view, rig, f"replayed from the start at step {step}")
                replayed.append(view.batches)
            finally:
                fresh.close()

    rig, ev = run_demo(cfg, on_step)
    try:
        idx.sync()
        assert_same(live, rig, "end")
        st = ev.stats()
        assert st["dropped"] == 0 and live.batches == st["batches"] == live.next_seq
        assert live.clears == 2  # the weight update and the reset
        # the run moved keys through every tier, and the comparisons saw them
        assert all(live.held[m] for m in ("GPU", "CPU", "DISK")), {m: len(k) for m, k in live.held.items()}
        assert len(samples) > 10 and max(samples) > 0
        assert len(replayed) > 3 and replayed == sorted(replayed) and replayed[-1] > 0
        # subscribers learn only chained keys, which a router derives from tokens
        assert set().union(*live.held.values()) <= chained_keys(rig)

        fresh = Indexer()  # joins after the run: everything comes from the replay buffer
        try:
            late = fresh.add("e0", cfg.endpoint, cfg.replay_endpoint, topic="kv@")
            fresh.sync()
            assert late.batches == st["batches"] and late.next_seq == st["batches"]
            assert_same(late, rig, "replayed from the start")
        finally:
            fresh.close()
    finally:
        ev.close()
        idx.close()


def test_a_subscriber_killed_mid_run_is_replaced_and_the_new_one_catches_up(tmp_path):
    cfg = config(tmp_path)
    first = Indexer()
    first.add("e0", cfg.endpoint, cfg.replay_endpoint)
    state = {"first": first, "second": None, "gaps_seen": 0}

    def on_step(step, rig, ev):
        if state["first"] is not None:
            state["first"].poll(0)
            if step == 150:  # the subscriber dies: nobody reads for a while
                state["first"].close()
                state["first"] = None
        elif state["second"] is None and step == 300:
            state["second"] = Indexer()
            state["second"].add("e0", cfg.endpoint, cfg.replay_endpoint)
        elif state["second"] is not None:
            state["second"].poll(0)

    rig, ev = run_demo(cfg, on_step)
    second = state["second"]
    try:
        assert second is not None
        second.poll(0.5)  # a live batch after the join shows the hole from seq 0
        view = second.view("e0")
        assert view.gaps >= 1, "the new subscriber never saw the gap in the sequence numbers"
        second.sync()
        assert view.next_seq == ev.stats()["batches"] and view.lost == 0
        assert_same(view, rig, "after the restart")
    finally:
        ev.close()
        if second is not None:
            second.close()


def start_subscriber(cfg, out) -> subprocess.Popen:
    """A subscriber process (tests.events.subscriber_proc), once it has subscribed."""
    proc = subprocess.Popen([sys.executable, "-m", "tests.events.subscriber_proc", cfg.endpoint, cfg.replay_endpoint,
                             str(out)], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    ready = Path(f"{out}.ready")
    deadline = time.monotonic() + 60
    while not ready.exists():
        assert proc.poll() is None and time.monotonic() < deadline, "the subscriber process did not start"
        time.sleep(0.02)
    return proc


def test_a_subscriber_process_killed_mid_run_is_replaced_and_the_new_one_ends_with_the_engines_index(tmp_path):
    cfg = config(tmp_path)
    procs = {"first": start_subscriber(cfg, tmp_path / "first.json")}

    def on_step(step, rig, ev):
        if step == 150:  # the subscriber dies without a word
            procs["first"].kill()
            procs["first"].wait(30)
        elif step == 300:
            procs["second"] = start_subscriber(cfg, tmp_path / "second.json")

    try:
        rig, ev = run_demo(cfg, on_step)
        try:
            second = procs["second"]
            second.send_signal(signal.SIGTERM)  # it takes the tail by replay, then reports
            assert second.wait(60) == 0
            got = json.loads((tmp_path / "second.json").read_text())
            assert got["gaps"] >= 1, "the new subscriber never saw the gap in the sequence numbers"
            assert got["next_seq"] == ev.stats()["batches"] and got["lost"] == 0
            want = engine_index(rig)
            for medium, keys in want.items():
                assert set(got["held"].get(medium, [])) == {k.hex() for k in keys}, medium
            assert not (tmp_path / "first.json").exists()  # killed: it never reported
        finally:
            ev.close()
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait(30)

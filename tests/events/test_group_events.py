# ruff: noqa: E402  (the imports below need the extra checked first)
"""KV events of a sliding-window hybrid layout: every block change carries its KV cache group
(vLLM's ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``). A subscriber
decoding the batches with vLLM main's structs (``tests/events/consumers.py``) and keeping a set
per (medium, group) holds, after every step, exactly the keys each group's device pool holds,
through preemptions, sliding windows giving blocks back, evictions and a reset_prefix_cache."""
from __future__ import annotations

from tests.optional import require_events

require_events()

import msgspec
import numpy as np
import pytest

from fastkv.cache.group_manager import GroupedManager
from fastkv.cache.manager import CacheConfig
from fastkv.cache.residency import Change, GroupTag, KeyInfo
from fastkv.cache.write_policy import Tier
from fastkv.config import KVLayout, cdiv
from fastkv.events import EventsConfig, KVEvents, build_events
from fastkv.events.schema import schema
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from fastkv.sched.output import StepOutput
from tests.events.consumers import VLLM

WINDOW = 6
LAYOUT = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=12, dtype="bfloat16", windows=(WINDOW, 0) * 2)
SYSTEM = [5, 9, 13, 17, 21, 25, 29, 33, 37]


class Collect:
    """A publisher that encodes each batch at once and keeps its bytes."""

    def __init__(self) -> None:
        self.payloads: list[bytes] = []

    def publish(self, make) -> int:
        self.payloads.append(msgspec.msgpack.encode(make()))
        return len(self.payloads) - 1

    def sync(self, timeout=None) -> bool:
        return True

    def stats(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class Subscriber:
    """What a router keeps: per (medium, group_idx) the block hashes stored and not removed."""

    def __init__(self) -> None:
        self.held: dict[tuple[str, int | None], set[bytes]] = {}
        self.kinds: dict[int | None, tuple[str | None, int | None]] = {}
        self.stored = self.removed = self.clears = 0
        self.parents_linked = 0
        self.applied = 0  # batches applied

    def catch_up(self, pub: Collect) -> None:
        for payload in pub.payloads[self.applied:]:
            self.apply(payload)
        self.applied = len(pub.payloads)

    def apply(self, payload: bytes) -> None:
        batch = msgspec.msgpack.decode(payload, type=VLLM["vllm-main"])
        for e in batch.events:
            tag = type(e).__name__
            if tag == "AllBlocksCleared":
                self.held.clear()
                self.clears += 1
            elif tag == "BlockStored":
                keys = self.held.setdefault((e.medium, e.group_idx), set())
                assert not keys & set(e.block_hashes), "a block stored twice in one group"
                keys.update(e.block_hashes)
                kind = (e.kv_cache_spec_kind, e.kv_cache_spec_sliding_window)
                assert self.kinds.setdefault(e.group_idx, kind) == kind, "a group changed its kind"
                assert len(e.token_ids) == len(e.block_hashes) * e.block_size
                self.stored += len(e.block_hashes)
                self.parents_linked += e.parent_block_hash is not None
            else:
                keys = self.held.setdefault((e.medium, e.group_idx), set())
                assert set(e.block_hashes) <= keys, "a block removed that the group never stored"
                keys.difference_update(e.block_hashes)
                self.removed += len(e.block_hashes)


def engine_view(cache: GroupedManager) -> dict[tuple[str, int], set[bytes]]:
    return {("GPU", gp.index): set(gp.pool.lookup) for gp in cache.groups.groups}


def run(group_blocks=(12, 12), n=8, max_new=12, chunk=16):
    cache = GroupedManager(CacheConfig(num_device_blocks=max(group_blocks), block_size=LAYOUT.block_size,
                                       layout=LAYOUT), group_blocks, chunk)
    pub = Collect()
    events = KVEvents(cache, EventsConfig(endpoint="ipc:///unused", schema="vllm"), publisher=pub)
    sub = Subscriber()
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=chunk, preemption=PreemptionMode.RECOMPUTE))
    for rid in range(n):
        prompt = (SYSTEM if rid % 2 else []) + [(rid * 31 + j * 7) % 90 + 1 for j in range(5 + 3 * rid)]
        sched.add_request(Request(rid, np.array(prompt, np.int32), max_new))
    steps = 0
    while sched.has_work():
        steps += 1
        assert steps < 3000, "the scheduler did not finish"
        out = sched.step()
        if out.plan.seqs:  # the token each sampling sequence gets: any id will do for the cache
            sampled = {s.request_id: (s.request_id * 13 + steps) % 90 + 1 for s in out.plan.seqs if s.sample}
            sched.on_step_output(StepOutput(out.plan.step_id, sampled, 0.0))
        events.flush()
        sub.catch_up(pub)
        held = {k: v for k, v in sub.held.items() if v}
        assert held == {k: v for k, v in engine_view(cache).items() if v}, f"step {steps}: subscriber differs"
    return cache, sched, events, sub, pub


def test_a_subscriber_holds_each_groups_keys_step_by_step():
    cache, sched, events, sub, pub = run()
    assert sched.stats.preempt_recompute > 0, "no preemption under pressure"
    # both groups announced, each with its kind and window, as vLLM names them
    assert sub.kinds == {0: ("sliding_window", WINDOW), 1: ("full_attention", None)}
    assert sub.stored > 0 and sub.removed > 0, (sub.stored, sub.removed)
    assert sub.parents_linked > 0  # a sliding group's blocks still name their chain's parent
    # the digests in the summary are the subscriber's sets
    resident = events.resident()
    for (medium, g), keys in sub.held.items():
        assert resident[f"{medium}/{g}"]["keys"] == len(keys)
    assert resident["CPU"]["keys"] == resident["DISK"]["keys"] == 0

    cache.reset_prefix_cache()  # the subscriber drops everything, then learns what is still held
    events.flush()
    sub.catch_up(pub)
    assert sub.clears == 1
    assert {k: v for k, v in sub.held.items() if v} == {k: v for k, v in engine_view(cache).items() if v}


def test_a_schema_that_cannot_name_a_group_refuses_a_groups_changes():
    info = KeyInfo(None, np.arange(4, dtype=np.int32).tobytes())
    change = Change(Tier.DEVICE, [(b"k" * 32, info)], [b"r" * 32], GroupTag(1, "sliding_window", 128))
    events = build_events(0, [change], 4, schema("vllm"))
    assert [(type(e).__name__, e.group_idx) for e in events] == [("BlockRemoved", 1), ("BlockStored", 1)]
    assert (events[1].kv_cache_spec_kind, events[1].kv_cache_spec_sliding_window) == ("sliding_window", 128)
    for name in ("llm-d", "vllm-array"):
        with pytest.raises(ValueError, match="cannot name a block's KV cache group"):
            build_events(0, [change], 4, schema(name))


def test_the_all_full_layouts_events_carry_no_group():
    """Without a group the events are today's: vLLM main's optional group fields are omitted."""
    info = KeyInfo(None, np.arange(4, dtype=np.int32).tobytes())
    events = build_events(0, [Change(Tier.DEVICE, [(b"k" * 32, info)], [])], 4, schema("vllm"))
    raw = msgspec.msgpack.decode(msgspec.msgpack.encode(events[0]))
    assert not {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window"} & set(raw)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_supervised_hybrid_runs_its_events_per_group(tmp_path):
    """``fastkv --quick --layer-windows 64,0 --kv-events-schema vllm``: groups stay on with KV
    events in vLLM's schema, and a subscriber's per-group sets give the summary's digests."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    import blake3
    import zmq

    from tests.optional import require_paddle

    require_paddle()  # the supervisor runs the ops: the cpu extra
    root = Path(__file__).resolve().parents[2]
    pub = f"ipc://{tmp_path}/kv-events"
    ctx = zmq.Context()
    sock = ctx.socket(zmq.SUB)
    sock.rcvhwm = 0
    sock.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sock.connect(pub)
    cmd = [sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(tmp_path / "out"),
           "--layer-windows", "64,0", "--kv-events-endpoint", pub, "--kv-events-schema", "vllm"]
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": str(root)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    payloads = []
    try:
        while proc.poll() is None:
            if sock.poll(200):
                payloads.append(sock.recv_multipart()[2])
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 0, err[-3000:]
        while sock.poll(1000):
            payloads.append(sock.recv_multipart()[2])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        ctx.destroy(linger=0)
    assert "KV cache groups: " in err and "KV cache groups off" not in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    sub = Subscriber()
    for p in payloads:
        sub.apply(p)
    assert sub.kinds == {0: ("sliding_window", 64), 1: ("full_attention", None)}
    ev = summary["kv_events"]
    assert len(payloads) == ev["batches"]
    for g in (0, 1):
        keys = sub.held.get(("GPU", g), set())
        assert ev["resident"][f"GPU/{g}"] == {"keys": len(keys),
                                               "digest": blake3.blake3(b"".join(sorted(keys))).hexdigest()}
    sliding, full = summary["kv_groups"]
    assert 0 < sliding["max_held_per_request"] <= cdiv(64, 16) + 1 < full["max_held_per_request"]

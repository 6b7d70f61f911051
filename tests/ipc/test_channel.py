from __future__ import annotations

import numpy as np
import pytest

from fastkv.ipc import (
    BadMessage,
    Channel,
    DoneMsg,
    Doorbell,
    Gather,
    Inbox,
    OutputMsg,
    PlanMsg,
    SignalArray,
    TaskMsg,
    encode,
)


def task(i: int) -> TaskMsg:
    return TaskMsg(i, 1, np.arange(i % 5, dtype=np.int32), np.arange(i % 5, dtype=np.int32))


def test_send_recv_and_drain(ns):
    ch = Channel.create(ns, "c", accept=[TaskMsg])
    ch.send_many([task(i) for i in range(10)])
    assert ch.recv(timeout=0).task_id == 0
    got = ch.recv_many(5, timeout=0)
    assert [m.task_id for m in got] == [1, 2, 3, 4, 5]
    assert [m.task_id for m in ch.recv_many(100, timeout=0)] == [6, 7, 8, 9]
    assert ch.recv(timeout=0.01) is None
    ch.close()


def test_large_plan_spans_slots(ns):
    ch = Channel.create(ns, "c", slot_size=64, nslots=64)
    tables = [np.arange(100, dtype=np.int32) + r for r in range(3)]
    ch.send(PlanMsg(1, ["a", "b", "c"], tables, tables, np.array([1, 2, 3], np.int32)))
    got = ch.recv(timeout=0)
    assert got.request_ids == ["a", "b", "c"]
    assert all(np.array_equal(a, b) for a, b in zip(got.block_tables, tables, strict=True))
    ch.close()


def test_wrong_type_and_bad_bytes_leave_the_channel_usable(ns):
    ch = Channel.create(ns, "c", accept=[TaskMsg])
    with pytest.raises(TypeError, match="carries"):
        ch.send(DoneMsg(1, 0, True))
    ch.send(task(1))
    ch.send_encoded([encode(DoneMsg(2, 0, True)), b"garbage", encode(task(3))[:-8]])
    ch.send(task(4))
    assert [m.task_id for m in ch.recv_many(10, timeout=0)] == [1]
    with pytest.raises(BadMessage, match="received a DoneMsg"):
        ch.recv_many(10, timeout=0)
    with pytest.raises(BadMessage, match="shorter than|unknown"):
        ch.recv_many(10, timeout=0)
    with pytest.raises(BadMessage, match="header says"):
        ch.recv_many(10, timeout=0)
    assert [m.task_id for m in ch.recv_many(10, timeout=0)] == [4]
    ch.close()


def test_untyped_channel_keeps_order_around_a_bad_message(ns):
    ch = Channel.create(ns, "c")
    ch.send_encoded([encode(task(1)), encode(task(2)), b"\0" * 8, encode(DoneMsg(3, 0, True))])
    assert [m.task_id for m in ch.recv_many(10, timeout=0)] == [1, 2]
    with pytest.raises(BadMessage, match="unknown message type id 0"):
        ch.recv_many(10, timeout=0)
    assert ch.recv_many(10, timeout=0) == [DoneMsg(3, 0, True)]
    ch.close()


def test_inbox_requires_its_bell_and_round_robins(ns):
    bell = Doorbell.create(ns, "bell")
    chans = [Channel.create(ns, f"done.{r}", bell=bell) for r in range(3)]
    lonely = Channel.create(ns, "other")
    with pytest.raises(ValueError, match="bell="):
        Inbox([chans[0], lonely], bell)
    inbox = Inbox(chans, bell)
    for r, ch in enumerate(chans):
        ch.send_many([DoneMsg(i, r, True) for i in range(4)])
    got = inbox.recv_many(6, timeout=0)
    assert len(got) == 6
    got += inbox.recv_many(100, timeout=0)
    for r in range(3):
        assert [m.task_id for m in got if m.rank == r] == [0, 1, 2, 3]
    assert inbox.recv_many(10, timeout=0.01) == []
    for ch in chans + [lonely]:
        ch.close()
    bell.close()


def test_gather_completes_when_all_ranks_ack_and_reports_errors():
    g = Gather(3)
    g.expect(1)
    g.expect(2)
    assert g.add(DoneMsg(1, 0, True, 10, 0.1)) is None
    assert g.add(DoneMsg(1, 2, False, 0, 0.3, "disk full")) is None
    assert g.missing(1) == [1]
    res = g.add(DoneMsg(1, 1, True, 10, 0.2))
    assert res.task_id == 1 and not res.ok and res.error == "rank 2: disk full"
    assert res.nbytes == 20 and res.seconds == 0.3
    with pytest.raises(ValueError, match="unknown or finished"):
        g.add(DoneMsg(1, 1, True))
    g.add(DoneMsg(2, 0, True))
    with pytest.raises(ValueError, match="duplicate"):
        g.add(DoneMsg(2, 0, True))
    assert g.fail_rank(1, "transfer pid 9 died") == []
    (res,) = [r for r in [g.add(DoneMsg(2, 2, True))] if r]
    assert not res.ok and res.error == "rank 1: transfer pid 9 died"
    g.expect(3)  # a rank that died before the task fails it too
    assert g.add(DoneMsg(3, 0, True)) is None
    assert g.add(DoneMsg(3, 2, True)).error == "rank 1: transfer pid 9 died"


def test_signals(ns):
    sig = SignalArray.create(ns, "signals", ["hb.engine", "ready.0", "ready.1"])
    other = SignalArray.attach(ns, "signals")
    sig["hb.engine"] = 41
    assert other.add("hb.engine") == 41 and sig["hb.engine"] == 42
    assert other.cas(1, 0, 7) and not other.cas(1, 0, 8)
    assert sig.snapshot() == {"hb.engine": 42, "ready.0": 7, "ready.1": 0}
    with pytest.raises(KeyError, match="no slot"):
        sig["nope"]
    with pytest.raises(ValueError, match="unique"):
        SignalArray.create(ns, "dup", ["a", "a"])
    sig.close()
    other.close()


def test_output_channel_roundtrip(ns):
    ch = Channel.create(ns, "out", accept=[OutputMsg])
    ch.send(OutputMsg(3, 12, 0.01, ["r1", "r2"], np.array([5, 6], np.int32)))
    got = ch.recv(timeout=1)
    assert got.step_id == 3 and got.tokens.tolist() == [5, 6] and got.request_ids == ["r1", "r2"]
    ch.close()


def test_gather_revive_and_expect_with_dead_ranks():
    g = Gather(2)
    assert g.fail_rank(0, "down") == [] and g.fail_rank(1, "down too") == []
    res = g.expect(1)  # every rank dead: complete at once
    assert res is not None and not res.ok and res.error == "rank 0: down; rank 1: down too"
    g.revive(0)
    assert g.dead == {1: "down too"}
    assert g.expect(2) is None and g.missing(2) == [0]
    res = g.add(DoneMsg(2, 0, True, 5, 0.1))
    assert res is not None and res.error == "rank 1: down too" and res.nbytes == 5
    g.revive(1)
    assert g.expect(3) is None and g.missing(3) == [0, 1]
    with pytest.raises(ValueError, match="not dead"):
        g.revive(1)


def test_inbox_add_and_remove(ns):
    bell = Doorbell.create(ns, "bell")
    a = Channel.create(ns, "a", bell=bell).bind("recv", "engine")
    b = Channel.create(ns, "b", bell=bell).bind("recv", "engine")
    lonely = Channel.create(ns, "lonely")
    inbox = Inbox([a], bell)
    with pytest.raises(ValueError, match="already listens"):
        inbox.add(a)
    with pytest.raises(ValueError, match="not this inbox's doorbell"):
        inbox.add(lonely)
    b_send = Channel.attach(ns, "b", bell=bell)
    b_send.send(DoneMsg(7, 1, True))
    assert inbox.recv_many(8, timeout=0.05) == []  # not listening to b yet
    inbox.add(b)
    assert [m.task_id for m in inbox.recv_many(8, timeout=1)] == [7]
    inbox.remove(b)
    assert inbox.channels == [a]
    for ch in (a, b, lonely, b_send):
        ch.close()
    bell.close()

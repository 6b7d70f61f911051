"""Several processes on real rings: ping-pong, fan-in through a doorbell, broadcast and
gather, peer death (SIGKILL) and timeouts. Every child attaches by name, like the
transfer processes and workers will."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from fastkv.ipc import (
    Broadcast,
    Channel,
    ChannelClosed,
    DoneMsg,
    Doorbell,
    Gather,
    Inbox,
    Namespace,
    PeerDied,
    PeerError,
    PeerTimeout,
    Side,
    TaskMsg,
    cleanup,
    doorbell,
)
from tests.ipc.helpers import CTX, reap, run_objects, start


@pytest.fixture
def no_slices(monkeypatch):
    """Sleep in one slice per wait: a lost wake-up then stalls the test until its timeout
    instead of being hidden by the 50 ms liveness slices. Forked children inherit it."""
    monkeypatch.setattr(doorbell, "SLICE_S", 3600.0)


def _echo(run_id: str, n: int) -> None:
    ns = Namespace.attach(run_id)
    inbound = Channel.attach(ns, "ping").bind("recv", "worker", 0)
    outbound = Channel.attach(ns, "pong").bind("send", "worker", 0)
    for _ in range(n):
        msg = inbound.recv(timeout=10)
        outbound.send(DoneMsg(msg.task_id, 0, True, int(msg.src.sum())))
    inbound.close()
    outbound.close()


def test_ping_pong(ns, no_slices):
    ping = Channel.create(ns, "ping").bind("send", "engine")
    pong = Channel.create(ns, "pong").bind("recv", "engine")
    child = start(_echo, ns.run_id, 200)
    for i in range(200):
        ping.send(TaskMsg(i, 1, np.arange(i % 9, dtype=np.int32), np.zeros(i % 9, np.int32)))
        got = pong.recv(timeout=10)
        assert (got.task_id, got.nbytes) == (i, sum(range(i % 9)))
    assert reap(child) == [0]
    ping.close()
    pong.close()


def _producer(run_id: str, rank: int, n: int) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, f"done.{rank}").bind("send", "transfer", rank)
    for start_i in range(0, n, 37):  # batches of various sizes, interleaved with singles
        ch.send_many([DoneMsg(i, rank, True) for i in range(start_i, min(n, start_i + 30))])
        for i in range(start_i + 30, min(n, start_i + 37)):
            ch.send(DoneMsg(i, rank, True))
    ch.close()


def test_four_producers_one_doorbell(ns, no_slices):
    n = 3000
    bell = Doorbell.create(ns, "engine.in")
    chans = [Channel.create(ns, f"done.{r}", bell=bell, nslots=64).bind("recv", "engine") for r in range(4)]
    inbox = Inbox(chans, bell)
    kids = [start(_producer, ns.run_id, r, n) for r in range(4)]
    seen = {r: [] for r in range(4)}
    total = 0
    while total < 4 * n:
        msgs = inbox.recv_many(100, timeout=10)
        assert msgs, f"stalled after {total} messages"
        for m in msgs:
            seen[m.rank].append(m.task_id)
        total += len(msgs)
    for r in range(4):
        assert seen[r] == list(range(n)), f"rank {r}: lost, duplicated or reordered messages"
    assert reap(*kids) == [0, 0, 0, 0]
    for ch in chans:
        with pytest.raises(ChannelClosed):
            ch.recv(timeout=1)
        ch.close()
    bell.close()


def _rank(run_id: str, rank: int, fail_task: int) -> None:
    ns = Namespace.attach(run_id)
    tasks = Channel.attach(ns, f"task.{rank}").bind("recv", "transfer", rank)
    done = Channel.attach(ns, f"done.{rank}").bind("send", "transfer", rank)
    while True:
        try:
            t = tasks.recv(timeout=10)
        except ChannelClosed:
            break
        ok = not (rank == 2 and t.task_id == fail_task)
        done.send(DoneMsg(t.task_id, rank, ok, 4 * len(t.src), 0.001, "" if ok else "bad block id 99"))
    done.close()


def test_broadcast_to_four_ranks_and_gather(ns, no_slices):
    bell = Doorbell.create(ns, "engine.in")
    tasks = [Channel.create(ns, f"task.{r}").bind("send", "engine") for r in range(4)]
    dones = [Channel.create(ns, f"done.{r}", bell=bell).bind("recv", "engine") for r in range(4)]
    kids = [start(_rank, ns.run_id, r, 5) for r in range(4)]
    bcast, gather, inbox = Broadcast(tasks), Gather(4), Inbox(dones, bell)
    for tid in range(10):
        gather.expect(tid)
        bcast.send(TaskMsg(tid, 1, np.arange(tid, dtype=np.int32), np.arange(tid, dtype=np.int32)))
    results = {r.task_id: r for r in gather.collect(inbox, timeout=10)}
    assert sorted(results) == list(range(10))
    assert all(results[t].ok and results[t].nbytes == 16 * t for t in results if t != 5)
    assert not results[5].ok and results[5].error == "rank 2: bad block id 99"
    for ch in tasks:
        ch.close()
    assert reap(*kids) == [0, 0, 0, 0]
    for ch in dones:
        ch.close()
    bell.close()


def _stream_forever(run_id: str) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, "done.0").bind("send", "transfer", 3)
    i = 0
    while True:
        ch.send(DoneMsg(i, 3, True), timeout=30)
        i += 1


def test_sigkilled_producer_is_reported_and_cleaned_up():
    ns = Namespace.create()
    try:
        ch = Channel.create(ns, "done.0", nslots=16).bind("recv", "engine")
        child = start(_stream_forever, ns.run_id)
        got = ch.recv_many(10, timeout=10)
        assert got, "producer never started"
        os.kill(child.pid, signal.SIGKILL)  # not reaped yet: a zombie, which still counts as dead
        t0 = time.monotonic()
        with pytest.raises(PeerDied) as err:
            while True:
                msgs = ch.recv_many(100, timeout=5)
                assert all(m.task_id == got[-1].task_id + 1 + i for i, m in enumerate(msgs)), "out of order"
                got = msgs or got
        assert time.monotonic() - t0 < 2.0
        assert (err.value.role, err.value.rank, err.value.pid) == ("transfer", 3, child.pid)
        assert f"transfer[3] pid {child.pid} died" in str(err.value)
        reap(child)
        ch.close()
    finally:
        ns.close()
    assert run_objects(ns.run_id) == []


def _consume_then_die(run_id: str, n: int) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, "task.0").bind("recv", "transfer", 1)
    ch.recv_many(n, timeout=10)
    os.kill(os.getpid(), signal.SIGKILL)


def test_blocked_producer_sees_consumer_death(ns):
    ch = Channel.create(ns, "task.0", nslots=4).bind("send", "engine")
    child = start(_consume_then_die, ns.run_id, 1)
    with pytest.raises(PeerDied, match=r"consumer transfer\[1\]"):
        for i in range(100):
            ch.send(TaskMsg(i, 1), timeout=10)
    reap(child)
    ch.close()


def _idle(run_id: str, conn) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, "task.0").bind("recv", "transfer", 2)
    conn.send("bound")
    conn.recv()  # hold the channel open without reading until told
    ch.close()


def test_timeouts_name_the_late_peer(ns):
    from tests.ipc.helpers import CTX

    ch = Channel.create(ns, "task.0", nslots=2).bind("send", "engine")
    back = Channel.create(ns, "done.0").bind("recv", "engine")
    parent, conn = CTX.Pipe()
    child = start(_idle, ns.run_id, conn)
    assert parent.recv() == "bound"
    ch.send_many([TaskMsg(1, 1), TaskMsg(2, 1)])
    t0 = time.monotonic()
    with pytest.raises(PeerTimeout, match=rf"consumer transfer\[2\] pid {child.pid}") as err:
        ch.send(TaskMsg(3, 1), timeout=0.3)
    assert 0.25 <= time.monotonic() - t0 < 2.0
    assert (err.value.role, err.value.rank, err.value.pid) == ("transfer", 2, child.pid)
    t0 = time.monotonic()
    assert back.recv(timeout=0.2) is None  # a receive timeout is "not now", not an error
    assert 0.15 <= time.monotonic() - t0 < 2.0
    parent.send("go")
    assert reap(child) == [0]
    ch.close()
    back.close()


def test_cleanup_of_crashed_run_leaves_nothing_even_while_objects_are_mapped():
    ns = Namespace.create()
    ch = Channel.create(ns, "task.0")
    ch.send(TaskMsg(1, 1))
    removed = cleanup(ns.run_id, force=True)  # what --cleanup does for a dead owner
    assert len(removed) == 5 and run_objects(ns.run_id) == []
    assert ch.recv(timeout=0).task_id == 1  # the mapping outlives the unlink
    ch.close()
    ns.close()


def _bind_and_close(run_id: str, conn) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, "task.0").bind("recv", "transfer", 1)
    conn.send("bound")
    if conn.recv() == "close":
        ch.close()  # a clean exit marks the consumer side closed


def test_rebind_refused_while_holder_lives_then_allowed_and_reopens(ns):
    from tests.ipc.helpers import CTX

    ch = Channel.create(ns, "task.0", nslots=8).bind("send", "engine")
    parent, conn = CTX.Pipe()
    child = start(_bind_and_close, ns.run_id, conn)
    assert parent.recv() == "bound"
    ch.send(TaskMsg(1, 1))  # left unread by the first consumer
    other = Channel.attach(ns, "task.0")
    with pytest.raises(PeerError, match=rf"consumer side is held by transfer\[1\] pid {child.pid}"):
        other.bind("recv", "transfer", 1)
    parent.send("close")
    assert reap(child) == [0]
    with pytest.raises(ChannelClosed, match="consumer closed"):
        ch.send(TaskMsg(2, 1))
    other.bind("recv", "transfer", 1)  # the successor takes over and reopens the side
    assert other.ring.peer(Side.CONSUMER).pid == os.getpid()
    ch.send(TaskMsg(3, 1))
    assert [m.task_id for m in other.recv_many(8, timeout=1)] == [1, 3]  # what the predecessor left stays
    ch.close()
    other.close()


def _send_and_close(run_id: str) -> None:
    ns = Namespace.attach(run_id)
    ch = Channel.attach(ns, "b").bind("send", "transfer", 1)
    ch.send(DoneMsg(5, 1, True))
    ch.close()


def _timed_recv(inbox: Inbox, conn) -> None:
    t0, c0 = time.monotonic(), time.process_time()
    got = inbox.recv_many(8, timeout=1.0)
    conn.send((got, time.monotonic() - t0, time.process_time() - c0))


def test_inbox_blocks_on_open_channels_once_a_producer_closed_and_exited(ns):
    """A producer that closed its end and exited (a clean shutdown) leaves the inbox
    waiting on the other channels in the kernel: no CPU, the timeout honoured, no
    PeerDied; the closed channel on its own raises ChannelClosed naming the producer."""
    bell = Doorbell.create(ns, "bell")
    a = Channel.create(ns, "a", bell=bell).bind("recv", "engine")
    b = Channel.create(ns, "b", bell=bell).bind("recv", "engine")
    child = start(_send_and_close, ns.run_id)
    assert reap(child) == [0]
    inbox = Inbox([a, b], bell)
    assert [m.task_id for m in inbox.recv_many(8, timeout=1)] == [5]  # delivered before the close counts
    parent, conn = CTX.Pipe()
    waiter = start(_timed_recv, inbox, conn)
    answered = parent.poll(10)
    if not answered:
        waiter.kill()
    reap(waiter)
    assert answered, "Inbox.recv_many ignored its timeout (spinning on the closed channel)"
    got, wall, cpu = parent.recv()
    assert got == []
    assert 0.9 <= wall < 3.0, wall
    assert cpu < 0.25 * wall, f"recv_many burnt {cpu:.2f} s CPU in {wall:.2f} s"
    with pytest.raises(ChannelClosed, match=rf"producer closed it \(transfer\[1\] pid {child.pid}\)"):
        b.recv(timeout=1)
    for ch in (a, b):
        ch.close()
    bell.close()

"""The engine-side client against fake transfer processes (this process, or forked children
that bind a rank's ends): adoption and fences, gathering, stale acks, death, replacement,
timeouts. No Paddle, no copies: the protocol only."""
from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import signal
import time

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import Channel, DoneMsg, Namespace, PeerDied, TaskMsg, landed
from fastkv.ipc.peers import me
from fastkv.run import RunSpec, attach_engine, attach_transfer, create_run
from fastkv.transfer.client import TransferClient
from fastkv.transfer.protocol import FENCE, FENCE_ID, fence_for, fence_names, fence_weights_version
from tests.ipc.helpers import reap, run_objects
from tests.transfer.helpers import plan

FORK = mp.get_context("fork")  # the fakes need no Paddle: fork is quick


@pytest.fixture
def run():
    ns = Namespace.create()
    spec = RunSpec(run_id=ns.run_id, layout=KVLayout(1, 1, 16, 16, "float32", tp_size=2), num_device_blocks=8,
                   num_host_blocks=8, heartbeat_s=0.05, dead_after_s=1.0, task_timeout_s=10.0, nslots=64)
    create_run(ns, spec)
    ends = attach_engine(ns, spec)
    yield ns, spec, ends
    ends.close()
    ns.close()
    assert run_objects(ns.run_id) == []


def results_until(client, ends, n, timeout=5.0):
    """The engine's loop until ``n`` results came back."""
    out, deadline = [], time.monotonic() + timeout
    while len(out) < n:
        assert time.monotonic() < deadline, f"only {len(out)} of {n} results after {timeout} s"
        try:
            msgs = ends.inbox.recv_many(64, timeout=0.05)
        except PeerDied as exc:
            out += client.on_peer_died(exc)
        else:
            out += [r for m in msgs for r in client.on_done(m)]
        out += client.check()
    return out


def test_fence_round_trips():
    peer = me("transfer", 3)
    msg = fence_for(peer, "v2")
    assert (msg.task_id, msg.kind) == (FENCE_ID, FENCE)
    assert fence_names(msg) == (peer.pid, peer.started) and fence_weights_version(msg) == "v2"
    with pytest.raises(ValueError, match="not a fence"):
        fence_names(TaskMsg(1, int(CopyKind.SWAP_IN)))


def test_without_transfer_processes_tasks_fail_at_once(run):
    ns, spec, ends = run
    client = TransferClient(ends, spec)
    assert not client.ready() and not client.rank_up(0)
    p = plan(CopyKind.SWAP_OUT, [1], [2])
    client.submit(p)
    assert client.pending == 0
    res, = client.check()
    assert res.plan is p and not res.ok and res.nbytes == 0
    assert res.error == "rank 0: no transfer process attached yet; rank 1: no transfer process attached yet"
    assert ends.tasks[0].ring.used() == 0, "a task was sent to a rank without a process"


def test_adoption_fences_then_gathers_acks(run):
    ns, spec, ends = run
    fake = [attach_transfer(ns, spec, r) for r in range(2)]  # this process plays both ranks
    try:
        client = TransferClient(ends, spec, kill_late=False)
        assert client.ready() and client.rank_up(1)
        p1, p2 = plan(CopyKind.SWAP_OUT, [1, 2], [3, 4]), plan(CopyKind.STORE, [5], [], [b"k" * 32])
        client.submit(p1)
        client.submit(p2)
        for r in range(2):
            fence, t1, t2 = fake[r].task.recv_many(8, timeout=1)
            assert fence_names(fence) == (os.getpid(), me("x", 0).started)
            assert (t1.task_id, t1.kind, list(t1.src), list(t1.dst)) == (p1.plan_id, 1, [1, 2], [3, 4])
            assert t2.keys == (b"k" * 32,)
        assert client.pending == 2
        assert client.on_done(DoneMsg(p1.plan_id, 1, False, 0, 0.2, "disk full")) == []
        res, = client.on_done(DoneMsg(p1.plan_id, 0, True, 100, 0.1))
        assert (res.plan, res.ok, res.error, res.nbytes, res.seconds) == (p1, False, "rank 1: disk full", 100, 0.2)
        assert client.on_done(DoneMsg(p1.plan_id, 0, True)) == [] and client.stale == 1  # a late duplicate
        fake[0].done.send(DoneMsg(p2.plan_id, 0, True, 7, 0.01))
        fake[1].done.send(DoneMsg(p2.plan_id, 1, True, 7, 0.02))
        res, = results_until(client, ends, 1)
        assert res.plan is p2 and res.ok and res.error == "" and res.nbytes == 14 and res.seconds == 0.02
        with pytest.raises(ValueError, match="rank 5"):
            client.on_done(DoneMsg(1, 5, True))
        with pytest.raises(TypeError, match="CopyPlan"):
            client.submit(TaskMsg(1, 1))
        assert client.pending == 0
    finally:
        for f in fake:
            f.close()


def test_the_inbox_spins_for_acks_only_while_no_storage_task_is_in_flight(run):
    """A rank's storage lane is a low-priority thread that a spinning engine would keep off a core
    (fastkv.ipc.doorbell, fastkv.transfer.lanes): the client turns its inbox's spin off from a
    storage task's submit to its result, and back on after the last one."""
    ns, spec, ends = run
    fake = [attach_transfer(ns, spec, r) for r in range(2)]
    try:
        client = TransferClient(ends, spec, kill_late=False)
        assert client.ready()
        spin = ends.inbox.bell.spin
        swap, store, load = (plan(CopyKind.SWAP_OUT, [1], [2]), plan(CopyKind.STORE, [5], [], [b"k" * 32]),
                             plan(CopyKind.LOAD, [], [6], [b"k" * 32]))
        client.submit(swap)
        assert spin.enabled
        client.submit(store)
        client.submit(load)
        assert not spin.enabled
        for p in (swap, store, load):
            for r in range(2):
                client.on_done(DoneMsg(p.plan_id, r, True))
            assert spin.enabled == (p is load), p.kind
        assert client.pending == 0
    finally:
        for f in fake:
            f.close()


def test_a_late_rank_that_cannot_be_killed_keeps_its_task_in_flight(run):
    ns, spec, ends = run
    fake = [attach_transfer(ns, spec, r) for r in range(2)]
    try:
        spec = dataclasses.replace(spec, task_timeout_s=0.3)
        client = TransferClient(ends, spec, kill_late=False)  # the late "process" is this one
        assert client.ready()
        p = plan(CopyKind.SWAP_IN, [0], [0])
        client.submit(p)
        assert client.on_done(DoneMsg(p.plan_id, 0, True, 5, 0.0)) == []
        with pytest.raises(AssertionError, match="only 0 of 1 results"):
            results_until(client, ends, 1, timeout=1.0)  # a copy from it could still land: never complete
        assert client.pending == 1
        client.submit(later := plan(CopyKind.SWAP_IN, [1], [1]))  # not queued behind the hang
        assert client.on_done(DoneMsg(later.plan_id, 0, True, 5, 0.0))[0].error == (
            f"rank 1: transfer[1] pid {os.getpid()} did not finish task {p.plan_id} within 0.3 s")
        fake[1].done.send(DoneMsg(p.plan_id, 1, True, 5, 0.0))  # it was only slow after all
        res, = results_until(client, ends, 1)
        assert res.plan is p and res.ok
    finally:
        for f in fake:
            f.close()


def test_a_timed_out_task_fails_only_once_its_killed_process_is_gone(run, monkeypatch):
    ns, spec, ends = run
    zero = attach_transfer(ns, spec, 0)
    hung, conn = _fork_fake(ns, spec, 1)
    try:
        spec = dataclasses.replace(spec, task_timeout_s=0.3)
        client = TransferClient(ends, spec)
        assert client.ready()
        p = plan(CopyKind.SWAP_IN, [0], [0])
        client.submit(p)
        zero.done.send(DoneMsg(p.plan_id, 0, True, 5, 0.0))
        with monkeypatch.context() as m:  # the SIGKILL has not taken effect yet (e.g. a process in D state)
            m.setattr(os, "kill", lambda *a: None)
            m.setattr(signal, "pidfd_send_signal", lambda *a: None, raising=False)
            with pytest.raises(AssertionError, match="only 0 of 1 results"):
                results_until(client, ends, 1, timeout=1.0)
        assert client.pending == 1 and hung.is_alive()
        os.kill(hung.pid, signal.SIGKILL)
        reap(hung)
        res, = results_until(client, ends, 1)
        assert res.plan is p and res.error == (f"rank 1: transfer[1] pid {hung.pid} did not finish task "
                                               f"{p.plan_id} within 0.3 s (killed)")
        assert not client.rank_up(1)
    finally:
        if hung.is_alive():
            hung.kill()
            hung.join()
        zero.close()


def test_a_hung_process_is_killed_and_its_task_fails(run):
    ns, spec, ends = run
    zero = attach_transfer(ns, spec, 0)
    hung, conn = _fork_fake(ns, spec, 1)
    try:
        spec = dataclasses.replace(spec, task_timeout_s=0.3)
        client = TransferClient(ends, spec)
        assert client.ready()
        client.submit(p := plan(CopyKind.SWAP_IN, [0], [0]))
        zero.done.send(DoneMsg(p.plan_id, 0, True, 5, 0.0))
        res, = results_until(client, ends, 1)
        hung.join(5)
        assert hung.exitcode == -signal.SIGKILL
        assert res.error.endswith("within 0.3 s (killed)"), res.error
    finally:
        if hung.is_alive():
            hung.kill()
        hung.join()
        zero.close()


def _fake_transfer(run_id: str, spec_json: str, rank: int, conn) -> None:
    """Binds rank's ends, then obeys: "recv" -> report what is queued, "die" -> exit without closing."""
    ns = Namespace.attach(run_id)
    ends = attach_transfer(ns, RunSpec.from_json(spec_json), rank)
    conn.send("bound")
    while conn.recv() == "recv":
        msgs = ends.task.recv_many(64, timeout=1)
        conn.send([(m.task_id, m.kind, fence_names(m) if m.kind == FENCE else None) for m in msgs])
    os._exit(0)


def _fork_fake(ns, spec, rank):
    parent, conn = FORK.Pipe()
    p = FORK.Process(target=_fake_transfer, args=(ns.run_id, spec.to_json(), rank, conn), daemon=True)
    p.start()
    assert parent.recv() == "bound"
    return p, parent


def test_death_replacement_and_stale_tasks(run):
    ns, spec, ends = run
    zero = attach_transfer(ns, spec, 0)
    first, first_conn = _fork_fake(ns, spec, 1)
    try:
        client = TransferClient(ends, spec, kill_late=False)
        assert client.ready()
        doomed = plan(CopyKind.SWAP_OUT, [1], [1])
        client.submit(doomed)
        zero.done.send(DoneMsg(doomed.plan_id, 0, True, 1, 0.0))  # the other rank finished its share
        first_conn.send("die")
        reap(first)
        # the inbox reports the dead producer of done.1; the client fails what rank 1 owed
        res, = results_until(client, ends, 1)
        assert res.plan is doomed and res.error == f"rank 1: transfer[1] pid {first.pid} died"
        assert not client.rank_up(1)
        assert ends.inbox.recv_many(8, timeout=0.1) == []  # done.1 is out of the inbox: no more PeerDied
        client.submit(while_down := plan(CopyKind.SWAP_OUT, [2], [2]))
        assert client.on_done(DoneMsg(while_down.plan_id, 0, True, 3, 0.0))[0].error == res.error
        second, second_conn = _fork_fake(ns, spec, 1)
        client.submit(after := plan(CopyKind.SWAP_IN, [3], [3]))  # adopts the new process first
        assert client.rank_up(1)
        second_conn.send("recv")
        queued = second_conn.recv()
        # what the first process left (its fence, the doomed task), then the successor's fence and its task
        assert queued == [(FENCE_ID, FENCE, (first.pid, queued[0][2][1])), (doomed.plan_id, 1, None),
                          (FENCE_ID, FENCE, (second.pid, queued[2][2][1])), (after.plan_id, 2, None)]
        Channel.attach(ns, "done.1").send(DoneMsg(after.plan_id, 1, True, 9, 0.0))  # as the successor would
        layers = spec.layout.num_layers  # and it landed the layered swap-in it acked (fastkv.ipc.landed)
        ends.signals[landed.slot(1)] = landed.Landed.mark_of(1, layers - 1, layers)
        zero.done.send(DoneMsg(after.plan_id, 0, True, 9, 0.0))
        res, = results_until(client, ends, 1)
        assert res.plan is after and res.ok and res.nbytes == 18
        # replaced without the client noticing the death first: detected at the next submit
        second_conn.send("die")
        reap(second)
        third, third_conn = _fork_fake(ns, spec, 1)
        client.submit(pending := plan(CopyKind.SWAP_IN, [4], [4]))
        assert client.rank_up(1)
        third_conn.send("recv")
        assert [q[0] for q in third_conn.recv()] == [FENCE_ID, pending.plan_id]
        third_conn.send("die")
        reap(third)
        zero.done.send(DoneMsg(pending.plan_id, 0, True, 1, 0.0))
        res, = results_until(client, ends, 1)
        assert res.plan is pending and res.error == f"rank 1: transfer[1] pid {third.pid} died"
        assert client.pending == 0
    finally:
        zero.close()


def test_on_peer_died_ignores_other_producers(run):
    ns, spec, ends = run
    client = TransferClient(ends, spec)
    assert client.on_peer_died(PeerDied("worker gone", "worker", 0, 12345)) == []


def test_submit_on_a_full_task_ring_fails_that_ranks_share(run):
    ns, spec, ends = run
    fake = [attach_transfer(ns, spec, r) for r in range(2)]
    try:
        client = TransferClient(ends, spec, kill_late=False)
        assert client.ready()
        big = plan(CopyKind.SWAP_OUT, np.arange(200), np.arange(200))  # ~1.6 KiB: 4 slots of 512 bytes
        n = 0
        while ends.tasks[1].ring.nslots - ends.tasks[1].ring.used() >= 4:
            client.submit(plan(CopyKind.SWAP_OUT, np.arange(200), np.arange(200)))
            n += 1
        fake[0].task.recv_many(256, timeout=1)  # rank 0 keeps up, rank 1 does not
        client.submit(big)
        res = [r for r in client.check() if r.plan is big]
        assert res == [] and client.pending == n + 1  # rank 0 still owes its ack
        res, = client.on_done(DoneMsg(big.plan_id, 0, True, 1, 0.0))
        assert not res.ok and res.error.startswith("rank 1: task ring full")
        assert client.rank_up(1)  # a full ring is not a death
    finally:
        for f in fake:
            f.close()


def test_consumer_gone_at_submit_and_oversized_plans(run):
    ns, spec, ends = run
    fake = [attach_transfer(ns, spec, r) for r in range(2)]
    try:
        client = TransferClient(ends, spec, kill_late=False)
        assert client.ready()
        with pytest.raises(ValueError, match="can never fit a task ring"):
            client.submit(plan(CopyKind.SWAP_OUT, np.arange(20000), np.arange(20000)))
        assert client.pending == 0 and ends.tasks[0].ring.used() == 1  # only the fence
        fake[1].task.close()  # transfer[1] closed its end (a clean exit)
        p = plan(CopyKind.SWAP_IN, [1], [1])
        client.submit(p)
        assert not client.rank_up(1)
        res, = client.on_done(DoneMsg(p.plan_id, 0, True, 4, 0.0))
        assert res.plan is p and "rank 1: transfer[1] is gone" in res.error and "consumer closed" in res.error
    finally:
        for f in fake:
            f.close()

"""Two ranks in two transfer processes (spawned, as the supervisor starts them) driven by the
engine-side client: byte-identical swaps and storage round trips, failures as acks, SIGKILL
and hang recovery with a restarted process, clean stop."""
from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import pid_alive
from tests.optional import require_paddle
from tests.transfer.helpers import (
    Supervisor,
    device_blocks,
    fill_random,
    key,
    plan,
    pump,
    run_tasks,
    set_device_blocks,
    wait_ready,
)

require_paddle()
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def run2(tmp_path_factory):
    sup = Supervisor(storage_url=f"lmdb://{tmp_path_factory.mktemp('lmdb')}")
    try:
        client = sup.engine()
        for r in range(2):
            sup.start(r)
        wait_ready(client)
        yield sup, client
    finally:
        codes = sup.close()
    assert codes == {0: 0, 1: 0}, f"transfer processes did not stop cleanly: {codes}"


def test_ready_processes_publish_pid_beat_and_ready(run2):
    sup, client = run2
    for r in range(2):
        assert sup.signals[f"transfer{r}.pid"] == sup.procs[r].pid
        assert sup.signals[f"transfer{r}.ready"] == 1
        assert client.rank_up(r)
    before = [sup.signals[f"transfer{r}.beat"] for r in range(2)]
    time.sleep(3 * sup.spec.heartbeat_s)  # idle processes still beat (their wait times out)
    assert all(sup.signals[f"transfer{r}.beat"] > b for r, b in enumerate(before))


def test_swap_out_then_in_is_byte_identical_on_both_ranks(run2):
    sup, client = run2
    rng = np.random.default_rng(7)
    for dev in sup.devices:
        fill_random(dev, rng)  # different bytes per rank
    src, host_ids, back = [3, 9, 0, 14, 7], [1, 2, 12, 5, 0], [15, 4, 8, 1, 11]
    want = [device_blocks(dev, src) for dev in sup.devices]
    out, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, src, host_ids))
    assert out.ok, out.error
    assert out.nbytes == 2 * len(src) * sup.spec.layout.block_bytes and out.seconds > 0
    for dev in sup.devices:
        set_device_blocks(dev, src, 0)
    for dev, w in zip(sup.devices, want, strict=True):
        assert not any(np.array_equal(a, b) for a, b in zip(device_blocks(dev, src), w, strict=True))
    res, = run_tasks(sup, client, plan(CopyKind.SWAP_IN, host_ids, back))
    assert res.ok, res.error
    for dev, w in zip(sup.devices, want, strict=True):
        for got, exp in zip(device_blocks(dev, back), w, strict=True):
            assert np.array_equal(got.view(np.uint8), exp.view(np.uint8))
    assert client.pending == 0


def test_store_then_load_through_lmdb_is_byte_identical(run2):
    sup, client = run2
    rng = np.random.default_rng(8)
    for host in sup.hosts:
        fill_random(host, rng)
    keys = [key(i, "store") for i in range(4)]
    want = [host.array[[6, 7, 8, 9]].copy() for host in sup.hosts]
    res, = run_tasks(sup, client, plan(CopyKind.STORE, [6, 7, 8, 9], [], keys))
    assert res.ok, res.error
    for host in sup.hosts:
        host.array[:] = 0
    res, miss = run_tasks(sup, client, plan(CopyKind.LOAD, [], [0, 1, 2, 3], keys),
                          plan(CopyKind.LOAD, [], [4, 5], [keys[0], key(50, "never")]))
    assert res.ok, res.error
    for host, w in zip(sup.hosts, want, strict=True):
        assert np.array_equal(host.array[0:4].view(np.uint8), w.view(np.uint8))
    assert not miss.ok and miss.nbytes == 2 * sup.spec.layout.block_bytes
    assert miss.error == ("rank 0: loaded 1 of 2 blocks; not loaded: host blocks [5]; "
                          "rank 1: loaded 1 of 2 blocks; not loaded: host blocks [5]")


def test_bad_task_fails_with_the_ops_message_and_the_process_lives_on(run2):
    sup, client = run2
    bad, good = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [0, 99], [1, 2]), plan(CopyKind.SWAP_OUT, [0], [1]))
    assert not bad.ok and bad.nbytes == 0
    assert bad.error.startswith("rank 0: ValueError: ") and "; rank 1: ValueError: " in bad.error
    assert "99" in bad.error, bad.error
    assert good.ok, good.error
    assert all(p.is_alive() for p in sup.procs.values())
    with pytest.raises(ValueError, match="already pending"):
        p = plan(CopyKind.SWAP_OUT, [0], [1])
        client.submit(p)
        client.submit(p)
    pump(sup, client, [p.plan_id])


def test_clear_and_restore_through_the_processes(run2):
    sup, client = run2
    clear, refused = run_tasks(sup, client, plan(CopyKind.CLEAR), plan(CopyKind.SWAP_OUT, [0], [0]))
    assert clear.ok, clear.error
    assert not refused.ok and refused.error.count("caches cleared for a weight update") == 2
    restore, swap = run_tasks(sup, client, plan(CopyKind.RESTORE, keys=[b"1"]), plan(CopyKind.SWAP_OUT, [0], [0]))
    assert restore.ok and swap.ok, (restore.error, swap.error)


def big_layout() -> KVLayout:
    return KVLayout(num_layers=4, kv_heads=4, block_size=64, head_dim=128, dtype="bfloat16", tp_size=2)  # 512 KiB


def test_sigkill_during_long_tasks_fails_them_and_a_restarted_process_works():
    sup = Supervisor(layout=big_layout(), num_device_blocks=64, num_host_blocks=64, task_timeout_s=20.0)
    try:
        client = sup.engine()
        for r in range(2):
            sup.start(r)
        wait_ready(client)
        old_pid = sup.procs[1].pid
        n = 64
        plans = [plan(CopyKind.SWAP_OUT if i % 2 == 0 else CopyKind.SWAP_IN, range(n), range(n)[::-1])
                 for i in range(24)]  # 24 x 32 MiB per rank: long enough to be killed in the middle
        killed_at = [0.0]
        for p in plans:
            client.submit(p)

        def on_result(res):  # kill rank 1 once the first task is through: it is busy with the next
            if not killed_at[0]:
                os.kill(old_pid, signal.SIGKILL)
                killed_at[0] = time.monotonic()

        got = pump(sup, client, [p.plan_id for p in plans], timeout=20.0, on_result=on_result)
        detected = time.monotonic() - killed_at[0]
        assert detected < sup.spec.task_timeout_s, f"death noticed after {detected:.1f} s"
        failed = [got[p.plan_id] for p in plans if not got[p.plan_id].ok]
        assert failed, "the kill came after every task had finished"
        for res in failed:
            assert res.error == f"rank 1: transfer[1] pid {old_pid} died", res.error
        assert not client.rank_up(1) and client.pending == 0
        # while rank 1 is down its share fails at once; rank 0 still copies
        down, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [0], [0]))
        assert not down.ok and down.error == f"rank 1: transfer[1] pid {old_pid} died"
        assert down.nbytes == sup.spec.layout.block_bytes

        sup.start(1)  # the supervisor's restart
        wait_ready(client)
        assert sup.signals["transfer1.gen"] == 1 and sup.procs[1].pid != old_pid
        rng = np.random.default_rng(9)
        fill_random(sup.devices[1], rng)
        want = device_blocks(sup.devices[1], [5, 6])
        out, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [5, 6], [40, 41]))
        set_device_blocks(sup.devices[1], [5, 6], 0)
        back, = run_tasks(sup, client, plan(CopyKind.SWAP_IN, [40, 41], [5, 6]))
        assert out.ok and back.ok, (out.error, back.error)
        for got_b, exp in zip(device_blocks(sup.devices[1], [5, 6]), want, strict=True):
            assert np.array_equal(got_b, exp)
    finally:
        codes = sup.close()
    assert codes[0] == 0 and codes[1] == 0, codes


def _wait_stopped(pid: int) -> None:
    deadline = time.monotonic() + 10
    while True:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "T":
                return
        assert time.monotonic() < deadline, f"pid {pid} did not stop"
        time.sleep(0.01)


def test_hung_process_times_out_is_killed_and_its_stale_tasks_never_run():
    sup = Supervisor(task_timeout_s=1.0)
    try:
        client = sup.engine()
        for r in range(2):
            sup.start(r)
        wait_ready(client)
        hung = sup.procs[1].pid
        os.kill(hung, signal.SIGSTOP)
        _wait_stopped(hung)
        # queued behind the hang, never taken: stale once the task fails
        stale = [plan(CopyKind.SWAP_IN, [3], [3]), plan(CopyKind.SWAP_IN, [4], [4])]
        t0 = time.monotonic()
        for p in stale:
            client.submit(p)
        got = pump(sup, client, [p.plan_id for p in stale])
        waited = time.monotonic() - t0
        assert 1.0 <= waited < 5.0, waited
        for p in stale:
            assert got[p.plan_id].error == (f"rank 1: transfer[1] pid {hung} did not finish task {stale[0].plan_id} "
                                            f"within 1.0 s (killed)")
        sup.procs[1].join(10)
        assert not pid_alive(hung) and sup.procs[1].exitcode == -signal.SIGKILL
        # if the restarted process ran the stale SWAP_INs, device blocks 3 and 4 would get host blocks 3 and 4
        sup.hosts[1].array[3:5] = 1
        set_device_blocks(sup.devices[1], [3, 4], 0x5A)
        sup.start(1)
        wait_ready(client)
        res, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [0], [0]))
        assert res.ok, res.error  # the restarted process has read past the stale tasks by now
        for a in device_blocks(sup.devices[1], [3, 4]):
            assert (a.view(np.uint8) == 0x5A).all(), "a stale task ran after the restart"
        assert client.stale == 0
    finally:
        codes = sup.close()
    assert codes[0] == 0 and codes[1] == 0, codes


def test_a_restarted_process_adopts_the_current_weights_version(tmp_path):
    """After a weight update, a restarted process stores and loads under the new version
    (it learns it from its fence), so the new version's values verify."""
    sup = Supervisor(layout=KVLayout(1, 1, 16, 16, "float32", tp_size=1), num_device_blocks=4, num_host_blocks=4,
                     storage_url=f"lmdb://{tmp_path}")
    try:
        client = sup.engine()
        sup.start(0)
        wait_ready(client)
        sup.hosts[0].array[0] = 3.0
        sup.hosts[0].seal([0])  # as if it had landed by a copy
        restore, store = run_tasks(sup, client, plan(CopyKind.RESTORE, keys=[b"1"]),
                                   plan(CopyKind.STORE, [0], [], [key(0, "w1")]))
        assert restore.ok and store.ok, (restore.error, store.error)
        old = sup.procs[0].pid
        os.kill(old, signal.SIGKILL)
        sup.procs[0].join(10)
        deadline = time.monotonic() + 10
        while client.rank_up(0):  # the engine notices the death (the supervisor restarts after it)
            assert time.monotonic() < deadline, "the client did not notice the killed process"
            assert client.check() == []
            time.sleep(0.05)
        sup.start(0)
        wait_ready(client)
        load, = run_tasks(sup, client, plan(CopyKind.LOAD, [], [2], [key(0, "w1")]))
        assert load.ok, load.error
        assert (sup.hosts[0].array[2] == 3.0).all()
    finally:
        codes = sup.close()
    assert codes[0] == 0, codes

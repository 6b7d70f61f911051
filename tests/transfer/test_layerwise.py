"""Layer-wise loading on one rank: a layered SWAP_IN is acked once verified and before it copies,
lands layer-major and posts each layer on the rank's landed counter; a corrupt host block fails
it before the ack with nothing landed; and a step whose copy has one late layer waits for that
layer and no other."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.engine.runners.synthetic import SyntheticRunner
from fastkv.ipc import DoneMsg, SignalArray, TaskMsg
from fastkv.ipc.landed import Landed
from fastkv.sched.output import SeqWork, StepPlan
from fastkv.transfer.executor import TaskExecutor
from tests.optional import require_paddle
from tests.transfer.helpers import Supervisor, device_blocks, fill_random

require_paddle()
RANK = 1


@pytest.fixture
def sup():
    sup = Supervisor()
    yield sup
    sup.close()


@pytest.fixture
def rig(sup):
    sig = SignalArray.attach(sup.ns, "signals")
    ex = TaskExecutor(sup.spec, RANK)
    ex.landed = Landed.attach(sup.ns, sig, RANK, sup.spec.layout.num_layers)
    waiter = Landed.attach(sup.ns, sig, RANK, sup.spec.layout.num_layers)
    yield ex, waiter
    ex.landed.close()
    waiter.close()
    ex.close()
    sig.close()


def layered(n: int, src, dst) -> TaskMsg:
    return TaskMsg(1000 + n, int(CopyKind.SWAP_IN), np.asarray(src, np.int32), np.asarray(dst, np.int32), (), n)


def test_the_ack_comes_before_the_copy_which_lands_layer_by_layer(sup, rig):
    ex, waiter = rig
    layers = sup.spec.layout.num_layers
    rng = np.random.default_rng(3)
    dev, host = sup.devices[RANK], sup.hosts[RANK]
    fill_random(dev, rng)
    fill_random(host, rng)
    src, dst = [4, 0, 9], [7, 2, 11]
    events: list[tuple] = []
    acks: list[DoneMsg] = []

    def early(done: DoneMsg) -> None:
        acks.append(done)
        events.append(("ack", waiter.value()))

    def before_layer(task: int, layer: int) -> None:
        # this layer not copied yet, every layer before it landed and posted
        got = [np.array_equal(dev.k_arrays[layer][d], host.array[s, layer, 0]) for s, d in zip(src, dst, strict=True)]
        events.append(("layer", layer, waiter.landed(task, layer), waiter.landed(task, layer - 1) if layer else True,
                       any(got)))

    ex.layer_delay = before_layer
    assert ex.run(layered(5, src, dst), early=early) is None, "a layered SWAP_IN acks itself"
    assert len(acks) == 1 and acks[0].ok and acks[0].nbytes == 3 * sup.spec.layout.block_bytes, acks
    assert events[0] == ("ack", 0), f"the ack must precede the first layer's copy: {events}"
    assert events[1:] == [("layer", i, False, True, False) for i in range(layers)], events
    assert waiter.landed(5, layers - 1) and not waiter.landed(6, 0)
    want = [host.array[src, layer, kv] for kv in range(2) for layer in range(layers)]
    got = device_blocks(dev, dst)  # every layer's K, then every layer's V
    for w, g in zip(want, got, strict=True):
        assert np.array_equal(w, g)


def test_a_corrupt_host_block_fails_before_the_ack_and_lands_nothing(sup, rig):
    ex, waiter = rig
    rng = np.random.default_rng(4)
    dev, host = sup.devices[RANK], sup.hosts[RANK]
    fill_random(dev, rng)
    fill_random(host, rng)
    host.array[9].view(np.uint8).reshape(-1)[77] ^= 0x10  # bytes that changed since they landed
    before = device_blocks(dev, [2, 5])
    acks: list[DoneMsg] = []
    ex.run(layered(8, [3, 9], [2, 5]), early=acks.append)
    assert len(acks) == 1 and not acks[0].ok and "checksum" in acks[0].error, acks
    for b, a in zip(before, device_blocks(dev, [2, 5]), strict=True):
        assert np.array_equal(b, a), "a refused layered copy wrote the device"
    assert waiter.landed(8, sup.spec.layout.num_layers - 1), "posted whole: a step on this rank must not hang on it"


def test_a_whole_swap_in_without_the_early_callback_is_unchanged(sup, rig):
    ex, waiter = rig
    rng = np.random.default_rng(5)
    dev, host = sup.devices[RANK], sup.hosts[RANK]
    fill_random(dev, rng)
    fill_random(host, rng)
    done = ex.run(layered(9, [1], [3]))  # no early callback: an in-process caller gets its ack back
    assert done is not None and done.ok
    assert np.array_equal(device_blocks(dev, [3])[0], host.array[1, 0, 0][None])
    assert not waiter.landed(9, 0), "the whole path posts nothing"


def test_a_step_waits_for_its_late_layer_and_no_other(sup, rig):
    """Layer 1 of 4 copies late: the synthetic runner's step, started when the ack came, waits
    only before layer 1; layers 0, 2 and 3 were there when it asked (2 and 3 land while it waits
    for 1, as the lane goes on layer-major)."""
    from dataclasses import replace

    from fastkv.config import KVLayout

    layout = KVLayout(num_layers=4, kv_heads=2, block_size=16, head_dim=32, dtype="bfloat16", tp_size=2)
    sup2 = Supervisor(layout=layout, num_device_blocks=8, num_host_blocks=8)
    try:
        sig = SignalArray.attach(sup2.ns, "signals")
        ex = TaskExecutor(replace(sup2.spec), RANK)
        ex.landed = Landed.attach(sup2.ns, sig, RANK, layout.num_layers)
        waiter = Landed.attach(sup2.ns, sig, RANK, layout.num_layers)
        rng = np.random.default_rng(6)
        fill_random(sup2.devices[RANK], rng)
        fill_random(sup2.hosts[RANK], rng)
        late, delay = 1, 0.4
        ex.layer_delay = lambda task, layer: time.sleep(delay) if layer == late else None
        dev = sup2.devices[RANK]
        runner = SyntheticRunner(layout, RANK, 2, dev.k_arrays, dev.v_arrays, verify="off", vocab=64)
        waits: dict[int, float] = {}

        def wait(task: int, layer: int) -> float:
            waits[layer] = waiter.wait(task, layer, timeout=10)
            return waits[layer]

        runner.bind_layer_wait(wait)
        acked = threading.Event()
        copier = threading.Thread(target=ex.run, args=(layered(1, [0, 1], [4, 5]),),
                                  kwargs={"early": lambda d: acked.set()})
        copier.start()
        assert acked.wait(10)
        plan = StepPlan(1, [SeqWork(7, np.arange(5, dtype=np.int32), 0, np.array([6], np.int32), True)],
                        wait_landed=1)
        out = runner.step(plan)
        copier.join(10)
        assert 7 in out.sampled
        assert sorted(waits) == [0, 1, 2, 3], waits
        assert waits[late] >= 0.6 * delay, f"the step did not wait for its late layer: {waits}"
        others = [waits[layer] for layer in waits if layer != late]
        assert max(others) < 0.25 * delay, f"the step waited for layers that had landed: {waits}"
        ex.landed.close()
        waiter.close()
        ex.close()
        sig.close()
    finally:
        sup2.close()


def test_the_engine_waits_only_for_copies_still_landing_into_a_plans_blocks(sup):
    """``LandingCopies``: a plan waits, per rank, for the layered copies that rank acked into a
    block of its tables, until the rank's counter shows them landed; other plans wait for nothing."""
    from fastkv.transfer.landing import LandingCopies

    sig = SignalArray.attach(sup.ns, "signals")
    layers = sup.spec.layout.num_layers
    posts = [Landed.attach(sup.ns, sig, r, layers) for r in range(2)]
    try:
        book = LandingCopies(2, layers, sig)
        a = book.number(100, np.array([0, 1], np.int32), np.array([3, 4], np.int32))
        b = book.number(101, np.array([2], np.int32), np.array([9], np.int32))
        assert (a, b) == (1, 2) and book.wait_for([np.array([3])]) is None, "not acked: nothing lands yet"
        book.on_ack(100, 0, True)
        book.on_ack(100, 1, True)
        book.on_ack(101, 0, True)
        book.on_ack(101, 1, False)  # rank 1 refused it: nothing of it lands there
        assert book.wait_for([np.array([0, 1, 2])]) is None, "a plan on other blocks waits for nothing"
        assert book.wait_for([np.array([7]), np.array([4, 5])]).tolist() == [1, 1]
        assert book.wait_for([np.array([9])]).tolist() == [2, 0]
        posts[0].post(1, layers - 1)
        assert book.wait_for([np.array([4])]).tolist() == [0, 1], "landed on rank 0, still landing on rank 1"
        assert [t[0] for t in book.torn(1)] == [1] and [t[0] for t in book.torn(0)] == [2]
        assert book.torn(1)[0][1].tolist() == [0, 1] and book.torn(1)[0][2].tolist() == [3, 4]
        posts[1].post(1, layers - 1)
        posts[0].post(2, layers - 1)
        assert book.wait_for([np.array([3, 4, 9])]) is None
        assert book.torn(0) == book.torn(1) == []
    finally:
        for p in posts:
            p.close()
        sig.close()


def slow_layer_main(spec_json: str, rank: int, late_s: float) -> None:
    """A transfer process whose layered copies stall ``late_s`` before their last layer."""
    import sys

    from fastkv.transfer import process
    from fastkv.transfer.executor import TaskExecutor

    TaskExecutor.layer_delay = staticmethod(lambda task, layer: time.sleep(late_s) if layer == 1 else None)
    sys.exit(process.main(spec_json, rank))


def test_a_copy_its_process_left_half_done_is_redone_by_its_successor():
    """transfer[1] acks a layered SWAP_IN, lands layer 0 and dies before layer 1. Its blocks stay
    'landing' on rank 1 (a plan holding them still waits there); the supervisor's replacement,
    once adopted, copies it again first, and rank 1's device ends up with the host bytes."""
    from tests.transfer.helpers import CTX, plan, run_tasks, set_device_blocks, wait_ready

    sup = Supervisor(layerwise_load=True)
    try:
        client = sup.engine()
        sup.start(0)
        sup.procs[1] = CTX.Process(target=slow_layer_main, args=(sup.spec.to_json(), 1, 60.0), daemon=True)
        sup.procs[1].start()
        wait_ready(client)
        rng = np.random.default_rng(7)
        for r in range(2):
            fill_random(sup.hosts[r], rng)
            set_device_blocks(sup.devices[r], [5, 6], 0)
        layers = sup.spec.layout.num_layers
        waiter = Landed.attach(sup.ns, sup.signals, 1, layers)
        try:
            res, = run_tasks(sup, client, plan(CopyKind.SWAP_IN, [3, 4], [5, 6]))
            assert res.ok and res.layered, res
            waiter.wait(1, 0, timeout=20)  # layer 0 landed on rank 1; layer 1 waits out the stall
            assert not waiter.landed(1, 1)
            assert client.landing.wait_for([np.array([6])]).tolist() == [0, 1]
            sup.procs[1].kill()
            down, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [0], [0]))  # fails on the dead rank
            assert not down.ok and "died" in down.error
            sup.start(1)
            wait_ready(client)  # adopting it sends the redo right after its fence
            waiter.wait(1, layers - 1, timeout=20)
            after, = run_tasks(sup, client, plan(CopyKind.SWAP_OUT, [1], [1]))  # its acks flow again
            assert after.ok, after.error
            for r in range(2):
                dev, host = sup.devices[r], sup.hosts[r]
                for layer in range(layers):
                    assert np.array_equal(dev.k_arrays[layer][[5, 6]], host.array[[3, 4], layer, 0]), (r, layer)
                    assert np.array_equal(dev.v_arrays[layer][[5, 6]], host.array[[3, 4], layer, 1]), (r, layer)
            assert client.landing.wait_for([np.array([5, 6])]) is None
        finally:
            waiter.close()
    finally:
        sup.close()

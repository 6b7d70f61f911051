"""The per-rank landed counter of layer-wise loading (fastkv.ipc.landed): a waiter blocks on the
semaphore until the layer it asks for was posted, a later task's post means earlier tasks landed,
a late layer times out naming it, and nobody spins while waiting."""
from __future__ import annotations

import multiprocessing as mp
import resource
import threading
import time

import pytest

from fastkv.ipc import SignalArray
from fastkv.ipc.landed import Landed, LayerTimeout, sem_name, slot

LAYERS = 4


@pytest.fixture
def pair(ns):
    sig = SignalArray.create(ns, "signals", ["stop", slot(0)])
    ns.create_sem(sem_name(0)).close()
    poster, waiter = Landed.attach(ns, sig, 0, LAYERS), Landed.attach(ns, sig, 0, LAYERS)
    yield poster, waiter
    poster.close()
    waiter.close()
    sig.close()


def test_a_layer_is_landed_once_posted_and_every_layer_before_it(pair):
    poster, waiter = pair
    assert waiter.landed(0, LAYERS - 1), "task 0 is no copy: nothing to wait for"
    assert not waiter.landed(1, 0)
    poster.post(1, 1)
    assert waiter.landed(1, 0) and waiter.landed(1, 1) and not waiter.landed(1, 2)
    assert not waiter.landed(2, 0)
    poster.post(3, 0)  # the lane runs tasks in order: task 3 started, so 1 and 2 are whole
    assert waiter.landed(1, LAYERS - 1) and waiter.landed(2, LAYERS - 1) and not waiter.landed(3, 1)


def test_a_wait_returns_when_its_layer_lands_not_before(pair):
    poster, waiter = pair
    posted: dict[int, float] = {}

    def copy() -> None:
        for layer in range(LAYERS):
            time.sleep(0.05)
            posted[layer] = time.monotonic()
            poster.post(5, layer)

    t = threading.Thread(target=copy)
    t.start()
    for layer in range(LAYERS):
        waiter.wait(5, layer, timeout=5)
        assert layer in posted and time.monotonic() >= posted[layer], f"layer {layer} returned before its post"
    t.join()
    assert waiter.wait(5, LAYERS - 1, timeout=0.01) == 0.0  # landed: no wait at all


def test_a_late_layer_times_out_naming_it_and_runs_the_check(pair):
    poster, waiter = pair
    poster.post(2, 0)
    checks = []
    with pytest.raises(LayerTimeout, match="layer 1 of layered copy 2 did not land"):
        waiter.wait(2, 1, timeout=0.3, check=lambda: checks.append(1), slice_s=0.05)
    assert len(checks) >= 3, "the check (a heartbeat) runs between slices of the wait"
    with pytest.raises(RuntimeError, match="gone"):
        waiter.wait(2, 1, timeout=5, check=lambda: (_ for _ in ()).throw(RuntimeError("transfer0 gone")),
                    slice_s=0.05)


def _post_later(run_id: str, delay: float) -> None:
    from fastkv.ipc import Namespace

    ns = Namespace.attach(run_id)
    sig = SignalArray.attach(ns, "signals")
    landed = Landed.attach(ns, sig, 0, LAYERS)
    time.sleep(delay)
    landed.post(1, LAYERS - 1)
    landed.close()
    sig.close()
    ns.close()


def test_a_waiter_in_another_process_blocks_without_burning_a_core(ns, pair):
    _, waiter = pair
    proc = mp.get_context("spawn").Process(target=_post_later, args=(ns.run_id, 0.5))
    proc.start()
    cpu0 = resource.getrusage(resource.RUSAGE_THREAD)
    t0 = time.monotonic()
    waited = waiter.wait(1, LAYERS - 1, timeout=30)
    wall = time.monotonic() - t0
    cpu1 = resource.getrusage(resource.RUSAGE_THREAD)
    proc.join(10)
    assert proc.exitcode == 0
    assert wall >= 0.4 and waited >= 0.4, "returned before the post"
    cpu = (cpu1.ru_utime - cpu0.ru_utime) + (cpu1.ru_stime - cpu0.ru_stime)
    assert cpu < 0.25 * wall, f"the wait burnt {cpu:.3f} s of CPU in {wall:.3f} s"


def test_a_workers_waiter_beats_and_ends_at_stop(pair):
    _, waiter = pair
    beats = []
    wait = waiter.waiter(timeout=30, beat=lambda: beats.append(1), slice_s=0.05)
    threading.Timer(0.3, lambda: waiter.signals.__setitem__("stop", 1)).start()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match="stop requested"):
        wait(1, 0)
    assert time.monotonic() - t0 < 5 and len(beats) >= 3

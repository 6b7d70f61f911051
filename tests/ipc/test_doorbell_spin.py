"""The doorbell's spin before sleep (fastkv.ipc.doorbell): a waiter watches its rings for a
while (without the GIL, unless its owner keeps it), so a message published meanwhile needs no
semaphore post; the spin stops where it does not pay and where its owner turns it off."""
from __future__ import annotations

import sys
import threading
import time

import pytest

from fastkv.ipc import Ring, doorbell
from fastkv.ipc.doorbell import PROBE_EVERY, SPIN_MAX_S, SPIN_MISSES, SPIN_S, Spin
from fastkv.ipc.native import A
from fastkv.transfer.lanes import GIL_SWITCH_S


def test_spins_stop_after_misses_probe_now_and_then_and_resume_on_a_hit():
    s, full = Spin(), int(SPIN_S * 1e9)
    for _ in range(SPIN_MISSES):
        assert s.budget_ns() == full
        s.ended(False)
    budgets = [s.budget_ns() for _ in range(3 * PROBE_EVERY)]
    assert budgets.count(full) == 3 and budgets.count(0) == 3 * PROBE_EVERY - 3
    s.ended(True)  # a probe found its answer: spinning pays again
    assert all(s.budget_ns() == full for _ in range(SPIN_MISSES))
    s.enabled = False
    assert s.budget_ns() == 0


def test_a_spin_grows_to_cover_answers_that_came_soon_after_it_and_shrinks_after_long_waits():
    s, first, most = Spin(), int(SPIN_S * 1e9), int(SPIN_MAX_S * 1e9)
    assert s.budget_ns() == first
    s.ended(False, 2 * first)  # a copy's ack, just after the spin gave up
    assert s.budget_ns() == 2 * first * 5 // 4
    s.ended(True)  # covered: answered within the spin
    assert s.budget_ns() == 2 * first * 5 // 4 and s.misses == 0
    s.ended(False, most)
    assert s.budget_ns() == most, "never past SPIN_MAX_S"
    s.ended(False, 5 * most)  # a model step: spinning longer would not have helped
    assert s.budget_ns() == first
    s.ended(False)  # no answer at all (a timed-out wait)
    assert s.budget_ns() == first


@pytest.mark.parametrize("most_s", [5.0, 0.01])
def test_a_waiter_learns_how_long_its_answers_take(ns, monkeypatch, most_s):
    """A wait's time, from the spin to the answer, reaches ``Spin.ended``: an answer 50 ms
    late makes the next spin cover it where SPIN_MAX_S allows (scaled up here, so that a slow
    machine cannot make the test flaky), and leaves it at SPIN_S where it does not."""
    monkeypatch.setattr(doorbell, "SPIN_MAX_S", most_s)
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    producer = threading.Timer(0.05, ring.push, (b"late",))
    try:
        producer.start()
        assert ring.pop_many(4, timeout=10) == [b"late"]
        budget = ring.data_bell.spin.budget
        if most_s > 1:
            assert budget >= int(0.05 * 1e9 * 5 / 4), "the next spin covers an answer this late"
        else:
            assert budget == int(SPIN_S * 1e9)
    finally:
        producer.join()
        ring.close()


def test_spin_any_returns_on_a_message_or_at_the_end_of_its_budget(ns):
    rings = [Ring.create(ns, f"r{i}", slot_size=32, nslots=4) for i in range(3)]
    try:
        hdrs = [r.hdr for r in rings]
        t0 = time.perf_counter()
        assert A.spin_any(hdrs, 2_000_000) is False
        assert time.perf_counter() - t0 >= 0.002
        rings[2].push(b"x")
        t0 = time.perf_counter()
        assert A.spin_any(hdrs, 5_000_000_000) is True
        assert time.perf_counter() - t0 < 1.0
        assert A.spin_any(hdrs[:2] * 40, 1000) is False  # an inbox of many ranks' channels
        assert A.spin_any(hdrs * 40, 1000) is True
        assert A.spin_any([], 1000) is False
        with pytest.raises(ValueError, match="aligned"):
            A.spin_any([hdrs[0] + 1], 1000)
    finally:
        for r in rings:
            r.close()


@pytest.mark.parametrize("spin", [True, False])
def test_a_spinning_waiter_takes_a_message_published_meanwhile_without_a_post(ns, monkeypatch, spin):
    monkeypatch.setattr(doorbell, "SPIN_S", 5.0)  # the producer thread surely publishes mid-spin
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    ring.data_bell.spin.enabled = spin
    go = threading.Event()

    def produce() -> None:
        go.wait()
        time.sleep(0.05)  # the consumer is spinning (or asleep) by now
        ring.push(b"late")

    producer = threading.Thread(target=produce)
    producer.start()
    try:
        go.set()
        assert ring.pop_many(4, timeout=10) == [b"late"]
    finally:
        producer.join()
    # spinning, the consumer never armed its doorbell; asleep, it needed the producer's post
    assert ring.data_bell.posts == (0 if spin else 1)
    assert ring.data_bell.spin.misses == 0
    ring.close()


def longest_stall_of_another_thread(during) -> float:
    """The longest time (s) a busy Python thread went without running while ``during()`` ran in
    this one."""
    longest, started, stop = [0.0], threading.Event(), threading.Event()

    def tick() -> None:
        last = time.perf_counter()
        started.set()
        while not stop.is_set():
            now = time.perf_counter()
            longest[0] = max(longest[0], now - last)
            last = now

    interval = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)  # as in a transfer process with a storage lane
    other = threading.Thread(target=tick)
    other.start()
    started.wait()
    time.sleep(0.01)  # it is running, not starting
    try:
        longest[0] = 0.0
        during()
        time.sleep(0.01)  # it runs again and sees the gap
        return longest[0]
    finally:
        stop.set()
        other.join()
        sys.setswitchinterval(interval)


def test_a_spin_that_keeps_the_gil_runs_no_other_python_thread(ns):
    """The transfer loop spins holding the GIL (fastkv.transfer.lanes): its low-priority storage
    thread must not take the GIL meanwhile. Without keep_gil the other thread runs on (it waits
    only for this thread's Python, at most a switch interval)."""
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    try:
        kept = longest_stall_of_another_thread(lambda: A.spin_any([ring.hdr], 200_000_000, True))
        released = longest_stall_of_another_thread(lambda: A.spin_any([ring.hdr], 200_000_000))
        assert kept >= 0.19, kept
        assert released < 0.1, released
        with pytest.raises(TypeError, match="2 or 3 arguments"):
            A.spin_any([ring.hdr], 1000, True, 1)
    finally:
        ring.close()


def test_a_waiter_that_keeps_the_gil_still_takes_a_message_published_meanwhile(ns, monkeypatch):
    """A message from another process arrives during a spin that holds the GIL (a thread here
    cannot publish meanwhile: it would need the GIL, so the spin ends at its budget and the
    waiter sleeps until the post)."""
    monkeypatch.setattr(doorbell, "SPIN_S", 0.01)
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    ring.data_bell.spin.keep_gil = True
    producer = threading.Timer(0.05, ring.push, (b"late",))
    try:
        producer.start()
        assert ring.pop_many(4, timeout=10) == [b"late"]
    finally:
        producer.join()
        ring.close()

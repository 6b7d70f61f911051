"""The doorbell's adaptive spin: a waiter looks at its rings before it sleeps only while that
pays (fastkv.ipc.doorbell), and a spin that finds the message returns it without a post."""
from __future__ import annotations

import time

from fastkv.ipc import Doorbell
from fastkv.ipc.doorbell import PROBE_EVERY, SPIN_MISSES, SPIN_S, Spin


def test_spins_stop_after_misses_probe_now_and_then_and_resume_on_a_hit():
    s = Spin()
    for _ in range(SPIN_MISSES):
        assert s.budget() == SPIN_S
        s.ended(False)
    budgets = [s.budget() for _ in range(3 * PROBE_EVERY)]
    assert budgets.count(SPIN_S) == 3 and budgets.count(0.0) == 3 * PROBE_EVERY - 3
    s.ended(True)  # a probe found its answer: spinning pays again
    assert all(s.budget() == SPIN_S for _ in range(SPIN_MISSES))
    s.enabled = False
    assert s.budget() == 0.0


def test_a_spinning_waiter_takes_a_message_published_meanwhile_without_sleeping(ns):
    bell = Doorbell.create(ns, "bell")
    try:
        looks = []

        def ready() -> bool:  # the message lands as the waiter looks for the third time: mid-spin
            looks.append(time.perf_counter())
            return len(looks) >= 3

        assert bell.wait(ready, timeout=1.0)
        assert len(looks) == 3 and looks[-1] - looks[0] < SPIN_S * 100, "it slept instead of spinning"
        assert bell.posts == 0 and bell.spin.misses == 0
        # no message: the spin ends, the waiter sleeps, and times out as before
        assert not bell.wait(lambda: False, timeout=0.01)
        assert bell.spin.misses == 1
    finally:
        bell.close()

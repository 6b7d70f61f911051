"""GpuClock: GPU seconds over the wall from the first step sent to the last output, and the
rest split by what the engine did while no step was in flight (a fake clock drives it)."""
from __future__ import annotations

import pytest

from fastkv.engine.timeline import GpuClock


class FakeClock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t

    def run(self, dt: float) -> None:
        self.t += dt


def test_synchronous_steps_split_the_wall():
    c = FakeClock()
    g = GpuClock(c)
    g.enter("schedule")
    c.run(5.0)  # before the first step: not counted
    for _ in range(3):
        g.enter("schedule")
        c.run(0.1)
        g.sent()
        c.run(1.0)  # 0.9 s of GPU, 0.1 s of round trip
        g.received(0.9)
        g.enter("schedule")
        c.run(0.05)
        g.enter("copies")
        c.run(0.2)
        g.enter("idle")
        c.run(0.3)
        g.enter("other")
    c.run(10.0)  # after the last output: not counted
    s = g.summary(extra_gpu_s=0.3)
    t = s["gpu_time"]
    # wall: from the first send to the third output: 3 x 1.0 in flight + 2 x (0.05 + 0.2 + 0.3 + 0.1) between
    assert t["wall"] == pytest.approx(3.0 + 2 * 0.65)
    assert t["gpu"] == pytest.approx(3 * 0.9 + 0.3)
    assert t["ipc"] == pytest.approx(3.0 - 3 * 0.9 - 0.3)
    assert t["schedule"] == pytest.approx(2 * 0.15)
    assert t["copies"] == pytest.approx(0.4) and t["idle"] == pytest.approx(0.6) and t["other"] == 0
    assert sum(v for k, v in t.items() if k != "wall") == pytest.approx(t["wall"])
    assert s["gpu_busy"] == pytest.approx(3.0 / 4.3, abs=1e-4)


def test_planning_while_a_step_runs_is_not_lost():
    """Step N+1 sent before step N's output: the time between counts as in flight, and a
    busy GPU reads 1 whatever the engine did meanwhile."""
    c = FakeClock()
    g = GpuClock(c)
    g.sent()
    for _ in range(4):
        g.enter("schedule")
        c.run(0.3)  # planning the next step while this one runs
        g.sent()
        c.run(0.7)
        g.received(1.0)
    g.enter("schedule")
    c.run(1.0)
    g.received(1.0)
    s = g.summary()
    assert s["gpu_busy"] == pytest.approx(1.0)
    assert s["gpu_time"]["schedule"] == 0 and s["gpu_time"]["ipc"] == pytest.approx(0)


def test_no_step_no_figure():
    g = GpuClock(FakeClock())
    g.enter("idle")
    assert g.summary() == {"gpu_busy": None, "gpu_time": {}}
    with pytest.raises(AssertionError):
        g.received(1.0)

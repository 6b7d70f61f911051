"""A run's timeline: one row ``[t_s, finished, generated_tokens, preemptions]`` (``COLUMNS``)
after every step that finished requests, and at least every ``every_s`` seconds, from the
start of the workload. Every role samples it the same way (summary.json ``timeline``;
report.json labels its columns ``timeline_columns``)."""
from __future__ import annotations

import time
from typing import Any

COLUMNS = ("t_s", "finished_requests", "generated_tokens", "preemptions")
EVERY_S = 0.25


class Timeline:
    def __init__(self, rows: list[list[float]], every_s: float = EVERY_S) -> None:
        self.rows, self.every_s = rows, every_s
        self.start = time.monotonic()
        self._last = 0.0

    def sample(self, engine: Any, finished: int, force: bool = False) -> None:
        """A row when ``force`` (requests finished) or ``every_s`` passed since the last one."""
        t = time.monotonic() - self.start
        if force or t - self._last >= self.every_s:
            self.rows.append(point(engine, finished, t))
            self._last = t


def point(engine: Any, finished: int, t: float) -> list[float]:
    return [round(t, 4), finished, engine.metrics.tokens_sampled, sum(engine.metrics.preemptions().values())]


# Where a run's wall time goes from the GPU's side (``GpuClock``): what the engine was doing
# while no step was in flight on the workers.
IDLE_PHASES = ("schedule", "copies", "idle", "other")


class GpuClock:
    """The GPU-busy figure of a run: GPU seconds over wall seconds, from the moment the first
    step was sent to the moment the last step's output came back.

    GPU seconds are what each step's output says the runner computed (under a cost model the
    modelled time), plus ``extra_gpu_s`` at the end (the synthetic runner's own byte work, which
    stands for work the GPU does inside a step). The wall is split by whether a step is in
    flight: time with one (or, with steps planned ahead, several) in flight is the GPU's and the
    round trip's (``ipc``: in-flight wall less GPU seconds: channels, the worker's own decoding);
    time with none is charged to the phase the engine was in (``IDLE_PHASES``: ``schedule``,
    the scheduler's and cache's work between steps; ``copies``, waiting on copies while nothing
    could run; ``idle``, waiting for arrivals; ``other``, the rest of the loop). Because the
    split follows steps in flight and not the engine's call order, planning step N+1 while step
    N runs counts as in flight, not as lost: the figure stays right when steps overlap."""

    def __init__(self, clock=time.perf_counter) -> None:
        self.clock = clock
        self.first: float | None = None
        self.in_flight = 0
        self.gpu_s = 0.0
        self._flight_s = 0.0
        self._phase_s = dict.fromkeys(IDLE_PHASES, 0.0)
        self._phase = "other"
        self._since = 0.0
        self._done: tuple[float, float, dict[str, float]] | None = None  # at the last output: wall, flight, phases

    def _tick(self) -> float:
        now = self.clock()
        if self.first is not None:
            if self.in_flight:
                self._flight_s += now - self._since
            else:
                self._phase_s[self._phase] += now - self._since
        self._since = now
        return now

    def enter(self, phase: str) -> None:
        """From now on the engine does ``phase`` (one of ``IDLE_PHASES``)."""
        assert phase in self._phase_s, f"unknown phase {phase!r}"
        self._tick()
        self._phase = phase

    def sent(self) -> None:
        """A step went to the workers."""
        now = self._tick()
        if self.first is None:
            self.first = now
        self.in_flight += 1

    def received(self, gpu_seconds: float) -> None:
        """A step's output came back; the runner computed ``gpu_seconds`` in it."""
        assert self.in_flight > 0, "a step's output with no step in flight"
        now = self._tick()
        self.in_flight -= 1
        self.gpu_s += max(0.0, gpu_seconds)
        self._done = (now - self.first, self._flight_s, dict(self._phase_s))

    def summary(self, extra_gpu_s: float = 0.0) -> dict[str, Any]:
        """``gpu_busy`` (None before any step came back) and ``gpu_time``: seconds of the wall
        (``wall``), of GPU work (``gpu``), and of the rest by cause (``ipc`` and ``IDLE_PHASES``);
        they add up to ``wall``."""
        if self._done is None or self._done[0] <= 0:
            return {"gpu_busy": None, "gpu_time": {}}
        wall, flight, phases = self._done
        gpu = min(self.gpu_s + max(0.0, extra_gpu_s), flight)  # a runner's clock never outruns the wall
        return {"gpu_busy": round(gpu / wall, 4), "gpu_time": {
            "wall": round(wall, 4), "gpu": round(gpu, 4), "ipc": round(flight - gpu, 4),
            **{p: round(s, 4) for p, s in phases.items()}}}

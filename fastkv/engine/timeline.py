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

"""Per-rank "layer landed" announcements: a layered SWAP_IN's progress, for the worker's steps.

A layered SWAP_IN (``TaskMsg.layered`` = n, the engine's n-th) copies host -> device layer by
layer. After layer l of task n the rank's transfer process stores ``n * (layers + 1) + l + 1``
in its slot ``transfer{r}.landed`` of the run's signal array (monotonic: the swap lane runs the
layered tasks in the order the engine numbered them, one at a time) and posts the semaphore
``landed.{r}``. The rank's worker waits for layer l of task n by blocking on that semaphore (with
a timeout, re-reading the slot) until the slot reaches ``n * (layers + 1) + l + 1``: no polling
loop. Every post wakes the one waiter of the rank; surplus posts only make later waits return at
once to re-read the slot.

A value of task m > n means task n has landed whole (the lane finished it first). A task that
fails before its ack (a corrupt host block, a bad id) is posted whole at once: nothing of it
lands. The engine's plan names per rank the last layered task that rank acked
(``PlanMsg.wait_landed``), so a worker never waits for a task its rank never ran.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import posix_ipc

from fastkv.ipc import semwait
from fastkv.ipc.namespace import Namespace
from fastkv.ipc.signals import SignalArray


def slot(rank: int) -> str:
    return f"transfer{rank}.landed"


def sem_name(rank: int) -> str:
    return f"landed.{rank}"


class LayerTimeout(TimeoutError):
    """A layer's KV did not land in time."""


class Landed:
    """One rank's landed counter: ``post`` on the transfer side, ``wait`` on the worker side."""

    def __init__(self, signals: SignalArray, sem: posix_ipc.Semaphore, rank: int, layers: int) -> None:
        if layers < 1:
            raise ValueError(f"layers must be >= 1, got {layers}")
        self.signals, self.sem, self.rank, self.layers = signals, sem, rank, layers
        self._slot = slot(rank)

    @classmethod
    def attach(cls, ns: Namespace, signals: SignalArray, rank: int, layers: int) -> Landed:
        return cls(signals, ns.open_sem(sem_name(rank)), rank, layers)

    @staticmethod
    def mark_of(task: int, layer: int, layers: int) -> int:
        """The slot's value once layer ``layer`` (0-based; ``layers`` - 1 = all) of task ``task`` landed."""
        return task * (layers + 1) + layer + 1

    def mark(self, task: int, layer: int) -> int:
        return self.mark_of(task, layer, self.layers)

    def value(self) -> int:
        return self.signals[self._slot]

    def post(self, task: int, layer: int) -> None:
        """Layer ``layer`` of layered task ``task`` is on the device (all before it too). Never
        lowers the slot: a copy done again after its process died re-posts layers that landed."""
        mark = self.mark(task, layer)
        if self.value() < mark:  # one writer: this rank's transfer process
            self.signals[self._slot] = mark
        self.sem.release()

    def landed(self, task: int, layer: int) -> bool:
        return task <= 0 or self.value() >= self.mark(task, layer)

    def wait(self, task: int, layer: int, timeout: float, check: Callable[[], None] = lambda: None,
             slice_s: float = 1.0) -> float:
        """Blocks until layer ``layer`` of task ``task`` (<= 0: nothing to wait for) has landed;
        returns the seconds waited. ``check()`` runs every ``slice_s`` waited (a heartbeat; it may
        raise). LayerTimeout after ``timeout`` seconds."""
        if self.landed(task, layer):
            return 0.0
        t0 = time.monotonic()
        target = self.mark(task, layer)
        while self.value() < target:
            left = timeout - (time.monotonic() - t0)
            if left <= 0:
                raise LayerTimeout(f"rank {self.rank}: layer {layer} of layered copy {task} did not land within "
                                   f"{timeout:g} s (transfer{self.rank} is late or gone)")
            if not semwait.acquire(self.sem, min(left, slice_s)):
                check()
        return time.monotonic() - t0

    def waiter(self, timeout: float, beat: Callable[[], None], slice_s: float) -> Callable[[int, int], float]:
        """``wait(task, layer)`` for a worker: beats every ``slice_s`` while it waits and ends the
        wait at once on the run's ``stop``; LayerTimeout after ``timeout`` (the copy's transfer
        process is gone or stuck, and the KV it acked is not all there)."""
        def check() -> None:
            beat()
            if self.signals["stop"]:
                raise TimeoutError(f"stop requested while waiting for transfer{self.rank}'s layers")

        return lambda task, layer: self.wait(task, layer, timeout, check, slice_s)

    def close(self) -> None:
        self.sem.close()

"""The lanes of a transfer process: swaps on the loop thread, storage I/O on a thread of its own.

One loop running every task in turn would let a slow STORE hold up a SWAP_IN that a running
request waits for. So each rank has two lanes:

* the swap lane (SWAP_OUT, SWAP_IN) is the loop thread itself: a swap pays no thread
  hand-off, and the loop reads the next tasks as soon as it is done;
* the storage lane (STORE, LOAD) is ``StorageLane``, one thread that runs them in order.
  The backends (LMDB, redis sockets), the value checksums and the copies release the
  GIL, so storage I/O runs beside the swaps; the thread blocks on a condition when idle.
  Between those calls it runs Python (headers, LMDB bookkeeping, key lists of a LOOKUP);
  a loop thread woken for a swap during a long Python stretch waits for the GIL up to the
  switch interval (CPython's 5 ms). Starting the lane's thread cuts the process's interval
  to ``GIL_SWITCH_S``, so it waits at most about that long. (Around LMDB writes the swap
  lane also stalls for CPU, whether the writes run in this process or another one:
  scripts/bench_lmdb_stall.py measures both.)

Swaps first. On few cores, the engine, the loop thread and a busy storage thread (a STORE
checks its host blocks' checksums, then writes them: memory-bound work for tens of ms) are
three runnable threads, and a woken loop thread or engine would wait for a core for
milliseconds; nice 19 is not enough, as the scheduler may wake the engine onto the core the
niced thread holds and let it run out its slice. So STOREs run under ``SCHED_IDLE`` (falling
back to nice +19 where that is refused): the kernel counts a core running only such threads as
idle when it places a woken thread, and preempts them at once for it. LOOKUP and LOAD, which a
request waits for, run at the thread's own priority where the kernel lets it return
(``Priority``). Idle cores still run the storage thread at full speed, and ``SCHED_IDLE`` is a
low weight, not a strict priority: a STORE on machines whose cores are all busy still moves,
slowly. Too slowly in two cases, where a STORE runs at the thread's own priority instead: while a
LOOKUP or LOAD waits behind it (the lane runs one task at a time, so a request would wait out the
starved STORE: a priority inversion, which timed lookups out beside a CPU hog), and while the
STOREs queued here pass ``urgent_store_blocks`` (the engine is about to skip STOREs, and the pool
would miss what the run computed).

The swap lane holds the GIL while it is awake. A thread under ``SCHED_IDLE`` that holds the
GIL when a busy core preempts it keeps it until the kernel runs it again, which on a machine
whose cores all run normal threads can take a scheduler tick or more: a swap lane that let the
GIL go would wait that long to take it back. So the loop spins for its next task holding the
GIL (``Spin.keep_gil``) and calls the copy and the SWAP_IN's checksums holding it
(``ops.c_abi(hold_gil=True)``). The storage thread's own calls into C (checksums, backends)
run on through a swap; it takes the GIL only between them, while the loop sleeps or runs
Python of its own. That narrows the window without closing it (the storage thread still takes
the GIL while the loop sleeps or runs Python); only a storage process of its own would close it.
bench_swap's ``lane_p99_ratio`` measures what is left (BENCHMARKS.md, Swap op and transfer path).

Barriers (CLEAR, RESTORE, a fence, a bad task message): the loop ``drain``\\ s the storage
lane first, so every task read before the barrier has finished and been acked.

Order. The loop reads tasks in the order the client sent them and dispatches them one at a
time, so a storage task is dispatched only once every swap sent before it has finished: a
STORE after the SWAP_OUT that fills its host blocks sees the swapped bytes. The other way
round a swap can meet host blocks that an earlier storage task is still on (a SWAP_IN of
blocks a LOAD is filling, a SWAP_OUT over blocks a STORE or LOAD is still on). ``HostHolds``
counts, per host block, the storage tasks dispatched on it and not yet done with it, the
LOADs (writers) apart from the STOREs (readers); a swap waits, part by part, until no
writer holds the blocks it reads (SWAP_IN) and no task at all holds the blocks it writes
(SWAP_OUT). A SWAP_IN of blocks a STORE is reading runs at once: both only read. A storage
task frees its blocks part by part, so a SWAP_IN right behind a LOAD copies block i while
block i+1 loads.

Within the storage lane, a LOOKUP or LOAD goes ahead of the STOREs queued before it: a request
waits for those, nobody for a STORE, and behind a backlog of write-through STOREs at the
storage link's speed an admission's LOOKUP would wait out all of them. A LOOKUP also goes ahead
of the LOADs queued, and runs between the parts of the LOAD or STORE running
(``run_waiting_lookups``): it is one small batch, and a new request's admission waits for it. Nothing depends on the
order: a STORE's host blocks are pinned, never a LOAD's destination, and a key is looked up or
loaded only once its STORE landed (else it is a miss, as in any other order).
"""
from __future__ import annotations

import logging
import os
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable

from fastkv.cache.plan import CopyKind
from fastkv.ipc import TaskMsg

log = logging.getLogger(__name__)
GIL_SWITCH_S = 2e-4  # the longest a woken loop thread waits for the GIL the storage lane holds
STORAGE_NICE = 19  # added to the storage thread's nice value (Linux: per thread; capped at 19)
BACKGROUND_KIND = int(CopyKind.STORE)  # the storage task nobody waits for
LOOKUP_KIND = int(CopyKind.LOOKUP)
# the order of the lane's queue: LOOKUPs (an admission waits for each), LOADs (a request waits), STOREs
_ORDER = {LOOKUP_KIND: 0, int(CopyKind.LOAD): 1, BACKGROUND_KIND: 2}


class Priority:
    """The storage thread's CPU priority, task by task. Nobody waits for a STORE (write-behind):
    it runs under ``SCHED_IDLE`` (module docstring). A request waits for its LOOKUP (admission
    gives it ``storage_lookup_timeout_s``) and its LOAD: those run at the thread's own priority,
    or a busy machine starves them (two engines on two cores would time out their lookups).
    Leaving ``SCHED_IDLE`` needs CAP_SYS_NICE or an RLIMIT_NICE that allows it; where the kernel
    refuses, the thread stays low for everything (nice +19)."""

    def __init__(self, tid: int, name: str) -> None:
        self.tid, self.name = tid, name
        self.low = False
        self.stuck = False  # lowered for good: the kernel would not give the priority back
        self.normal = os.sched_getscheduler(tid) if hasattr(os, "sched_getscheduler") else None

    def set(self, low: bool) -> None:
        if low == self.low or self.stuck:
            return
        try:
            if low:
                os.sched_setscheduler(self.tid, os.SCHED_IDLE, os.sched_param(0))
            else:
                os.sched_setscheduler(self.tid, self.normal, os.sched_param(0))
            self.low = low
            return
        except (AttributeError, OSError) as exc:  # not Linux, no permission, or a seccomp profile
            why = exc
        self.stuck = True
        if not low:  # it stays under SCHED_IDLE: still preempted at once, just for LOADs too
            log.warning("%s: cannot leave SCHED_IDLE for a LOAD or LOOKUP (%s): storage reads run at "
                        "the lowest CPU priority", self.name, why)
            return
        try:
            os.setpriority(os.PRIO_PROCESS, self.tid, os.getpriority(os.PRIO_PROCESS, self.tid) + STORAGE_NICE)
            self.low = True
        except OSError as exc:  # never fatal: only the swap lane's tail latency depends on it
            log.warning("%s: could not lower the storage thread's CPU priority: %s; %s", self.name, why, exc)


class Hold:
    """The host blocks one storage task has not yet finished with."""

    __slots__ = ("_cond", "_blocks", "_counts")

    def __init__(self, cond: threading.Condition, blocks: set[int], counts: dict[int, int]) -> None:
        self._cond, self._blocks, self._counts = cond, blocks, counts  # counts: HostHolds' map of this kind

    def release(self, blocks: Iterable[int] | None = None) -> None:
        """The task is done with ``blocks`` (default: all it still holds); wakes waiting swaps."""
        with self._cond:
            for b in self._blocks.copy() if blocks is None else blocks:
                if b in self._blocks:
                    self._blocks.discard(b)
                    left = self._counts[b] - 1
                    if left:
                        self._counts[b] = left
                    else:
                        del self._counts[b]
            self._cond.notify_all()


class HostHolds:
    """Host blocks that storage tasks are on; swaps wait for them (module docstring)."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._writers: dict[int, int] = {}  # host block -> LOADs on it
        self._readers: dict[int, int] = {}  # host block -> STOREs on it

    def hold(self, blocks: Iterable[int], writes: bool) -> Hold:
        """Called by the loop thread as it dispatches a storage task on ``blocks``."""
        mine, counts = set(blocks), self._writers if writes else self._readers
        with self._cond:
            for b in mine:
                counts[b] = counts.get(b, 0) + 1
        return Hold(self._cond, mine, counts)

    def wait(self, blocks: Iterable[int], writes: bool, progress: Callable[[], None], slice_s: float) -> None:
        """Returns once no LOAD holds any of ``blocks`` (nor a STORE, if the caller
        ``writes`` them), calling ``progress()`` every ``slice_s`` meanwhile. Only the loop
        thread adds holds, and it is the one waiting here, so holds can only go: empty
        tables need no lock."""
        if not self._writers and not (writes and self._readers):
            return
        blocks = [int(b) for b in blocks]
        with self._cond:
            while any(b in self._writers or (writes and b in self._readers) for b in blocks):
                if not self._cond.wait(slice_s):
                    progress()


class StorageLane:
    """One thread running storage tasks in the order they were submitted, LOOKUPs ahead of the
    LOADs and STOREs queued before them, LOADs ahead of the STOREs (module docstring).

    ``run(msg, hold)`` executes and acks one task. An exception out of it (the engine is
    gone, or a bug) ends the lane: the tasks still queued are dropped, their holds released,
    and ``check``/``drain`` re-raise it in the loop thread."""

    def __init__(self, run: Callable[[TaskMsg, Hold], None], name: str, urgent_store_blocks: int | None = None) -> None:
        self._run, self._name = run, name
        self._cond = threading.Condition()
        self._queue: deque[tuple[TaskMsg, Hold]] = deque()
        self._busy: TaskMsg | None = None  # the task running
        # STORE blocks queued past which STOREs run at the thread's own priority (None: never)
        self.urgent_store_blocks = urgent_store_blocks
        self._store_blocks = 0  # STORE blocks queued or running
        self._priority: Priority | None = None
        self._closed = False
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None

    def submit(self, msg: TaskMsg, hold: Hold) -> None:
        with self._cond:
            if self._error is not None or self._closed:
                hold.release()
                self.check()
                return
            queue = self._queue
            if msg.kind == BACKGROUND_KIND:
                self._store_blocks += len(msg.src)
            rank = _ORDER.get(msg.kind, 1)
            if not queue or _ORDER.get(queue[-1][0].kind, 1) <= rank:
                queue.append((msg, hold))
            else:  # ahead of the tasks of a later rank, behind those of its own queued before it
                queue.insert(next(i for i, (m, _) in enumerate(queue) if _ORDER.get(m.kind, 1) > rank), (msg, hold))
            if self._busy is not None and self._priority is not None:  # the running STORE may have to hurry
                self._priority.set(low=self._low(self._busy))
            self._cond.notify()
        if self._thread is None:  # started on the first storage task: runs without storage have none
            sys.setswitchinterval(min(sys.getswitchinterval(), GIL_SWITCH_S))
            self._thread = threading.Thread(target=self._serve, name=self._name, daemon=True)
            self._thread.start()

    def check(self) -> None:
        """Re-raises what ended the lane, if anything did."""
        if self._error is not None:
            raise self._error

    def drain(self, progress: Callable[[], None], slice_s: float) -> None:
        """Returns once every submitted task has run, calling ``progress()`` every ``slice_s``."""
        with self._cond:
            while self._queue or self._busy is not None:
                if not self._cond.wait(slice_s):
                    progress()
        self.check()

    def close(self) -> None:
        """Finishes the running task, drops the queued ones and joins the thread."""
        with self._cond:
            self._closed = True
            self._drop()
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join()

    def _drop(self) -> None:
        while self._queue:
            msg, hold = self._queue.popleft()
            if msg.kind == BACKGROUND_KIND:
                self._store_blocks -= len(msg.src)
            hold.release()

    def run_waiting_lookups(self) -> None:
        """Runs the LOOKUPs queued now; called on the lane's thread between the parts of the task
        it runs (they touch no host block, so they may run inside a LOAD or STORE)."""
        while True:
            with self._cond:
                if self._closed or self._error is not None or not self._queue:
                    return
                if self._queue[0][0].kind != LOOKUP_KIND:
                    return
                msg, hold = self._queue.popleft()
            self._run(msg, hold)

    def _low(self, msg: TaskMsg) -> bool:
        """Whether ``msg`` runs under SCHED_IDLE now (under ``_cond``): a STORE, unless a LOOKUP
        or LOAD waits behind it (it would wait out the STORE's starved run: a priority
        inversion) or STOREs are queued past ``urgent_store_blocks`` (the engine would soon skip
        STOREs: on a machine whose cores are all busy, SCHED_IDLE's share cannot keep up)."""
        if msg.kind != BACKGROUND_KIND:
            return False
        if self._queue and self._queue[0][0].kind != BACKGROUND_KIND:
            return False
        return self.urgent_store_blocks is None or self._store_blocks < self.urgent_store_blocks

    def _serve(self) -> None:
        priority = Priority(threading.get_native_id(), self._name)
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                msg, hold = self._queue.popleft()
                self._busy = msg
                self._priority = priority
                priority.set(low=self._low(msg))
            try:
                self._run(msg, hold)
            except BaseException as exc:  # noqa: BLE001 - handed to the loop thread, which raises it
                self._error = exc
                hold.release()
            with self._cond:
                self._busy = None
                if msg.kind == BACKGROUND_KIND:
                    self._store_blocks -= len(msg.src)
                if self._error is not None:
                    self._drop()
                self._cond.notify_all()
                if self._error is not None:
                    return

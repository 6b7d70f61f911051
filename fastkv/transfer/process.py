"""The cache-transfer process of one tensor-parallel rank: ``main(spec_json, rank)``.

Start-up: attach the run's namespace, the rank's KV tiers (the supervisor created them)
and the storage backend, load the swap ops (the supervisor built them; started without one,
this process builds them here, under the startup timeout, never inside a task under the
heartbeat), and only then bind the task and done channels (a bound rank can work at once);
write ``transfer{r}.pid`` and ``transfer{r}.ready = 1``.

Loop: block on the task channel for at most ``spec.heartbeat_s`` (one semaphore wait,
draining up to 256 tasks per wake-up), beat ``transfer{r}.beat`` (``time.monotonic_ns()``)
on every wake-up and after every task, and post one ``DoneMsg`` per task. Swaps run on this
thread, STORE and LOAD on the storage lane's; CLEAR, RESTORE and the fence wait for the
storage lane to drain (``fastkv.transfer.lanes``), so acks of the two lanes interleave and
the client matches them by task id. Tasks before the FENCE addressed to this process are
dropped unexecuted: they were sent to a predecessor and the client has failed them
(``fastkv.transfer.protocol``). A task message that cannot be read (a corrupt frame,
undecodable bytes) is a barrier too, then acked as failed under ``BAD_TASK_ID``: every
task read before it has been acked, none after it, so it is the oldest task the rank owes.

Exit: 0 when signal ``stop`` is set or the engine closed the task channel; 1 when the
engine died. ``ready`` goes back to 0 and the ring ends are closed on the way out.
Heartbeats come from this loop, not from a timer thread, so a silent heartbeat means a
stuck loop: inside a long task the executor beats after every part it completes
(``fastkv.transfer.executor``), so only a single block slower than ``spec.dead_after_s``
looks dead.
"""
from __future__ import annotations

import logging
import sys
import threading
import time

from fastkv.cache.plan import CopyKind
from fastkv.cache.store_backlog import TAIL_SHARE
from fastkv.ipc import BadMessage, ChannelClosed, DoneMsg, Namespace, PeerDied, PeerTimeout, SignalArray, TaskMsg
from fastkv.ipc.landed import Landed
from fastkv.ipc.peers import me
from fastkv.kernels import ops
from fastkv.run import EXITING, READY, RunSpec, TransferEnds, attach_transfer
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.lanes import Hold, StorageLane
from fastkv.transfer.protocol import BAD_TASK_ID, FENCE, fence_names, fence_weights_version
from fastkv.transfer.tiers import select_device

log = logging.getLogger(__name__)
BATCH = 256
SWAPS = frozenset((int(CopyKind.SWAP_OUT), int(CopyKind.SWAP_IN)))
STORAGE_HOST_IDS = {int(CopyKind.STORE): "src", int(CopyKind.LOAD): "dst"}  # the host blocks each is on


class EngineGone(Exception):
    """The engine closed its end (clean, code 0) or died (code 1)."""

    def __init__(self, code: int, why: str) -> None:
        super().__init__(why)
        self.code = code


class TransferLoop:
    """The receive-execute-acknowledge loop of one transfer process."""

    def __init__(self, spec: RunSpec, rank: int, ends: TransferEnds, executor: TaskExecutor) -> None:
        self.spec, self.rank, self.ends, self.executor = spec, rank, ends, executor
        self.signals: SignalArray = ends.signals
        self.me = me("transfer", rank)
        self.fenced = False  # the client's fence for this process has arrived
        self.beat_slot = f"transfer{rank}.beat"
        self.executed = 0
        self.dropped = 0  # stale tasks left by a predecessor
        self.published = {"host_checksum_mismatches": 0, "released_bytes": 0}  # already added to the signals
        # STOREs hurry once half of what the engine lets unshared tails fill is queued here, before
        # it skips any (fastkv.cache.store_backlog)
        self.storage = StorageLane(self._run_stored, f"transfer{rank}-storage",
                                   urgent_store_blocks=int(spec.storage_backlog_blocks * TAIL_SHARE / 2))
        self._acking = threading.Lock()  # both lanes ack on the one done ring

    def beat(self) -> None:
        self.signals[self.beat_slot] = time.monotonic_ns()

    def publish_counters(self) -> None:
        """Adds the executor's new host checksum mismatches and released bytes to the run's
        counters (they outlive this process)."""
        for name, done in self.published.items():
            new = getattr(self.executor, name.removeprefix("host_")) - done
            if new:
                self.signals.add(f"transfer{self.rank}.{name}", new)
                self.published[name] += new

    def run(self) -> int:
        """Serves tasks until ``stop``; returns the exit code."""
        # the loop spins for its next task holding the GIL, as it copies (fastkv.transfer.lanes)
        self.ends.task.ring.data_bell.spin.keep_gil = True
        try:
            while not self.signals["stop"]:
                try:
                    msgs = self.ends.task.recv_many(BATCH, timeout=self.spec.heartbeat_s)
                except BadMessage as exc:  # the ring or codec dropped exactly this message
                    self.reject(exc)
                    msgs = []
                except ChannelClosed:
                    raise EngineGone(0, "the engine closed the task channel") from None
                except PeerDied as exc:
                    raise EngineGone(1, str(exc)) from None
                self.beat()
                self.storage.check()
                for msg in msgs:
                    self.handle(msg)
        except EngineGone as gone:
            (log.info if gone.code == 0 else log.error)("transfer[%d]: %s; exiting", self.rank, gone)
            return gone.code
        return 0

    def handle(self, msg: TaskMsg) -> None:
        if msg.kind == FENCE:
            try:
                mine = fence_names(msg) == (self.me.pid, self.me.started)
            except ValueError as exc:  # not from a TransferClient: nobody waits for an ack
                log.error("transfer[%d]: ignoring %s", self.rank, exc)
                return
            if mine:
                self.barrier()
                self.fenced = True
                self.executor.adopt_weights(fence_weights_version(msg))
            return
        if not self.fenced:
            self.dropped += 1
            return
        on = STORAGE_HOST_IDS.get(msg.kind)
        if on is not None:
            hold = self.executor.holds.hold(getattr(msg, on).tolist(), writes=msg.kind == CopyKind.LOAD)
            self.storage.submit(msg, hold)
            return
        if msg.kind == CopyKind.LOOKUP:  # storage I/O on no host block: never behind a swap, nor a barrier
            self.storage.submit(msg, self.executor.holds.hold((), writes=False))
            return
        if msg.kind not in SWAPS:  # CLEAR, RESTORE (and unknown kinds, which fail)
            self.barrier()
        done = self.executor.run(msg, progress=self.beat, early=self.finish)
        if done is not None:  # a layered SWAP_IN acked itself before its copy
            self.finish(done)

    def _run_stored(self, msg: TaskMsg, hold: Hold) -> None:
        self.finish(self.executor.run(msg, progress=self._between_parts, hold=hold))

    def _between_parts(self) -> None:
        """A storage task's part is done: beat, and answer the LOOKUPs that came meanwhile (a
        request waits for each; a LOAD or STORE of many blocks takes long on a busy machine)."""
        self.beat()
        self.storage.run_waiting_lookups()

    def barrier(self) -> None:
        """Returns once every task dispatched so far has finished and been acked."""
        self.storage.drain(self.beat, self.spec.heartbeat_s)

    def finish(self, done: DoneMsg) -> None:
        with self._acking:
            self.executed += 1
            errors, corrupt = self.executor.take_faults()  # published before the ack: the engine reads them after
            if errors:
                self.signals.add("storage.errors", errors)
            if corrupt:
                self.signals.add("storage.corrupt", corrupt)
            self.publish_counters()
            self.send(done)
        self.beat()

    def reject(self, exc: BadMessage) -> None:
        """A task message that cannot be read: ack it as failed (BAD_TASK_ID), so the
        engine fails that task alone instead of waiting for it until the timeout."""
        if not self.fenced:  # a predecessor's: the client has failed it already
            log.error("transfer[%d]: dropping a bad message sent before my fence: %s", self.rank, exc)
            self.dropped += 1
            return
        log.error("transfer[%d]: bad task message, acked as failed: %s", self.rank, exc)
        self.barrier()  # the client fails the oldest task the rank owes: acks of all before it go first
        with self._acking:
            self.send(DoneMsg(BAD_TASK_ID, self.rank, False, error=f"bad task message: {exc}"))

    def close(self) -> None:
        """Stops the storage lane after its running task (queued ones are dropped unacked:
        the engine is gone or stopping)."""
        self.storage.close()

    def send(self, done: DoneMsg) -> None:
        """Posts an ack (the caller holds ``_acking``); while the engine's ring is full,
        keeps beating and watching ``stop``."""
        while True:
            try:
                self.ends.done.send(done, timeout=self.spec.heartbeat_s)
                return
            except PeerTimeout:
                self.beat()
                if self.signals["stop"]:
                    raise EngineGone(0, "stop while the engine was not draining acks") from None
            except ChannelClosed:
                raise EngineGone(0, "the engine closed the done channel") from None
            except PeerDied as exc:
                raise EngineGone(1, str(exc)) from None


def main(spec_json: str, rank: int) -> int:
    """Entry point of transfer[rank] (``fastkv.run`` topology, ``RunSpec`` JSON)."""
    if not logging.getLogger().handlers:
        logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    ops.default_fatal_signals()
    spec = RunSpec.from_json(spec_json)
    select_device(spec.device_id(rank))  # the worker's device: CUDA IPC handles open there
    ns = Namespace.attach(spec.run_id)
    executor = TaskExecutor(spec, rank)
    try:
        ops.load()
        ends = attach_transfer(ns, spec, rank)
    except BaseException:
        executor.close()
        raise
    signals = ends.signals
    prefix = f"transfer{rank}"
    loop = TransferLoop(spec, rank, ends, executor)
    executor.landed = Landed.attach(ns, signals, rank, spec.layout.num_layers)
    try:
        signals[f"{prefix}.pid"] = loop.me.pid
        loop.beat()
        signals[f"{prefix}.ready"] = READY
        code = loop.run()
        log.info("transfer[%d]: executed %d tasks, dropped %d stale ones", rank, loop.executed, loop.dropped)
        return code
    finally:
        loop.close()
        if executor.landed is not None:
            executor.landed.close()
        signals[f"{prefix}.ready"] = EXITING
        ends.close()
        executor.close()

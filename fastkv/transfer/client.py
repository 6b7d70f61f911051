"""The engine's side of the transfer processes: submit copy plans, complete them from acks.

One ``TransferClient`` per engine. ``submit(plan)`` sends the same task (one encoding, one
task id) to every rank and returns at once; a task completes when every rank has acked
or failed it, and is ok only if every rank's copy succeeded. Results come back from the
engine's own calls, never from a thread and never by polling:

    try:
        msgs = ends.inbox.recv_many(256, timeout=spec.heartbeat_s)
    except PeerDied as exc:
        results = client.on_peer_died(exc)         # [] for a worker's channel: the engine's business
    else:
        results = [r for m in msgs if isinstance(m, DoneMsg) for r in client.on_done(m)]
    results += client.check()                      # at least once per step and on every timeout

Ranks. A rank is UP once the client has adopted its transfer process: a live process
bound as consumer of ``task.{r}`` and producer of ``done.{r}``, to which the client has
sent the FENCE naming it (``fastkv.transfer.protocol``). Adoption happens on first
contact (construction, ``submit``, ``check``, ``ready``), so start-up needs no handshake
beyond waiting for ``ready()`` before the first submit. A rank that is not UP fails its
share of every task at once ("rank r: <why>"); the other ranks still copy, and the task
completes when they have acked (its blocks stay in flight until no rank can touch them).

Death, replacement, timeouts. The client takes rank r down, failing every task pending
on it with the reason, when

* ``check()`` finds its process dead (pid and start time, from the ring's peer record),
  or another process bound in its place (a restart; ``bind`` refuses while the old one
  lives);
* ``on_peer_died`` gets the inbox's ``PeerDied`` for ``done.{r}``;
* a send to ``task.{r}`` finds the consumer dead or gone (its share of that task fails);
* a task is older than ``spec.task_timeout_s`` and rank r has not acked it: the process
  is presumed hung and is SIGKILLed (through a pidfd opened and identity-checked first,
  so a reused pid is never signalled). Its tasks fail only once it is confirmed gone (the
  pidfd turns readable within ``heartbeat_s``, or a later liveness check finds it dead),
  because a copy that lands after its task was failed would write blocks the engine has
  handed out again. Until then the rank is HUNG: its pending tasks stay in flight (so do
  their blocks) and new tasks fail its share at once. A process that cannot be killed
  (``kill_late=False``, or no permission) keeps its tasks in flight until it acks or dies.

While down, ``done.{r}`` is out of the inbox (a dead producer would make every inbox
wait raise). When the supervisor restarts transfer[r], the new process re-binds both
ends; the client adopts it on its next call: fence, back into the inbox, UP. The
restarted process drops every task queued before its fence unexecuted (the client failed
them all), and stale acks a dead process left in ``done.{r}`` are discarded at adoption
(``stale``). Acks of one rank come in the order its tasks finish (two lanes), matched by
task id; a ``BAD_TASK_ID`` ack (a task message the process could not read) fails the
oldest task that rank still owes (``fastkv.transfer.protocol`` says why that is the one).

Results of tasks that fail inside ``submit`` (every rank down) are returned by the next
``check``/``on_done``/``on_peer_died``.
"""
from __future__ import annotations

import logging
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fastkv.cache.plan import CopyKind, RestoreTask, Task
from fastkv.ipc import (
    BadMessage,
    ChannelClosed,
    DoneMsg,
    Gather,
    Peer,
    PeerDied,
    PeerTimeout,
    Side,
    TaskMsg,
    TaskResult,
)
from fastkv.run import EngineEnds, RunSpec
from fastkv.transfer.landing import LandingCopies
from fastkv.transfer.protocol import BAD_TASK_ID, REDO_IDS, fence_for, task_msg

log = logging.getLogger(__name__)
STORAGE_KINDS = frozenset((CopyKind.STORE, CopyKind.LOAD, CopyKind.LOOKUP))


class CopyResult(NamedTuple):
    plan: Task
    ok: bool
    error: str  # "rank r: <why>; ..." for every failed rank, "" when ok
    nbytes: int  # summed over ranks
    seconds: float  # the slowest rank's execution time
    layered: bool = False  # a layered SWAP_IN: acked before its copy, so ``seconds`` is not the copy's


@dataclass(slots=True)
class _Rank:
    owner: Peer | None = None  # the adopted (fenced) transfer process; None: rank down
    dead: Peer | None = None  # the last owner known dead (not to be adopted again)
    why: str = "no transfer process attached yet"  # why the rank is down
    listening: bool = True  # its done channel is in the engine's inbox
    hung: str = ""  # why its process is being killed (a task timed out); "" if not


class TransferClient:
    """Submits copy plans to every rank's transfer process and gathers their acks."""

    def __init__(self, ends: EngineEnds, spec: RunSpec, *, kill_late: bool = True) -> None:
        if len(ends.tasks) != spec.tp_size or len(ends.dones) != spec.tp_size:
            raise ValueError(f"engine ends have {len(ends.tasks)} task and {len(ends.dones)} done channels "
                             f"for tp_size {spec.tp_size}")
        self.ends, self.spec, self.kill_late = ends, spec, kill_late
        self.tp = spec.tp_size
        self._gather = Gather(self.tp)
        self._ranks = [_Rank() for _ in range(self.tp)]
        for r in range(self.tp):
            self._gather.fail_rank(r, self._ranks[r].why)
        self._plans: dict[int, tuple[Task, float]] = {}  # pending, in submit order
        self._storage_pending = 0  # of them, tasks on the storage tier (the ranks' storage lanes run them)
        self._ready: list[CopyResult] = []  # completed inside submit, handed out by the next call
        self._next_liveness = 0.0
        self.stale = 0  # acks ignored: for tasks already failed on that rank
        self.weights_version = spec.weights_version  # the latest RESTORE's: fences hand it to new processes
        # layer-wise loading: SWAP_INs go layer by layer, numbered in submit order (fastkv.transfer.landing)
        self.layerwise = spec.layerwise_load
        self.landing = LandingCopies(self.tp, spec.layout.num_layers, getattr(ends, "signals", None))
        self._redo: dict[int, list[tuple[int, np.ndarray, np.ndarray]]] = {}  # rank -> copies its successor redoes
        self._redo_ids: dict[int, tuple[int, int]] = {}  # task id of a redo -> (rank, layered number)
        self._next_redo_id = REDO_IDS
        for r in range(self.tp):
            self._try_adopt(r)

    # -- public API --------------------------------------------------------------------
    @property
    def pending(self) -> int:
        return len(self._plans)

    def rank_up(self, rank: int) -> bool:
        return self._ranks[rank].owner is not None

    def ready(self) -> bool:
        """Adopts every rank whose transfer process is attached; True once all are UP."""
        return all(self._ranks[r].owner is not None or self._try_adopt(r) for r in range(self.tp))

    def submit(self, plan: Task) -> None:
        """Sends ``plan`` to every rank under its plan id; never waits for the copy (a full
        task ring fails that rank's share at once). ValueError if the id is pending."""
        if not isinstance(plan, Task):
            raise TypeError(f"submit takes a CopyPlan or a control task, got {type(plan).__name__}")
        task_id = plan.plan_id
        if task_id in self._plans:
            raise ValueError(f"task {task_id} is already pending")
        layered = 0
        # a hybrid's per-group SWAP_IN moves one group's layers under that group's block ids, which
        # the layer counter (every layer, one id space) cannot tell apart: it is copied whole
        if self.layerwise and plan.kind is CopyKind.SWAP_IN and plan.group < 0:
            layered = self.landing.number(task_id, plan.src, plan.dst)
        buf = self.ends.tasks[0].encode(task_msg(plan, layered))
        ring = self.ends.tasks[0].ring
        if ring.slots_for(len(buf)) > ring.nslots:
            raise ValueError(f"task {task_id} ({plan.num_blocks} blocks, {len(buf)} bytes) can never fit a task "
                             f"ring of {ring.capacity_bytes} bytes: split the plan or raise spec.nslots")
        for r in range(self.tp):
            self._ready += self._refresh(r)
        if type(plan) is RestoreTask:
            self.weights_version = plan.weights_version
        self._plans[task_id] = (plan, time.monotonic())
        if plan.kind in STORAGE_KINDS:
            self._storage_pending += 1
            self._spin_for_acks()
        done = self._gather.expect(task_id)  # ranks that are down ack it as failed right here
        if done is not None:
            self._ready.append(self._finish(done))
            return
        for r in range(self.tp):
            if self._ranks[r].owner is None:
                continue
            if self._ranks[r].hung:  # never queued behind the hang, nor run by a successor
                self._ack_failed(task_id, r, self._ranks[r].hung)
                continue
            try:
                self.ends.tasks[r].send_encoded((buf,), timeout=0)
            except PeerTimeout as exc:
                self._ack_failed(task_id, r, f"task ring full: {exc}")
            except (PeerDied, ChannelClosed) as exc:
                self._ready += self._down(r, f"transfer[{r}] is gone: {exc}")

    def on_done(self, msg: DoneMsg) -> list[CopyResult]:
        """Records one rank's ack; returns the tasks it completed."""
        out = self._take_ready()
        if not 0 <= msg.rank < self.tp:
            raise ValueError(f"ack of task {msg.task_id} from rank {msg.rank}, not in [0, {self.tp})")
        if msg.task_id == BAD_TASK_ID:  # acked after every task before it, before any after it: the oldest owed
            owed = next((t for t in self._plans if msg.rank in self._gather.missing(t)), None)
            if owed is None:
                self.stale += 1
                return out
            log.error("transfer[%d]: task %d fails: %s", msg.rank, owed, msg.error)
            msg = DoneMsg(owed, msg.rank, False, msg.nbytes, msg.seconds, msg.error)
        if msg.task_id in self._redo_ids:
            self._redone(msg)
            return out
        if msg.task_id not in self._plans or msg.rank not in self._gather.missing(msg.task_id):
            self.stale += 1  # a dead or replaced process's ack for a task already failed on its rank
            return out
        self.landing.on_ack(msg.task_id, msg.rank, msg.ok)
        done = self._gather.add(msg)
        if done is not None:
            out.append(self._finish(done))
        return out

    def on_peer_died(self, exc: PeerDied) -> list[CopyResult]:
        """The engine's inbox raised ``PeerDied``: if it is a transfer process's done
        channel, take that rank down (its pending tasks fail). Other producers (worker 0's
        output) are the engine's business: nothing happens."""
        out = self._take_ready()
        for r in range(self.tp):
            peer = self.ends.dones[r].ring.peer(Side.PRODUCER)
            if peer.pid == exc.pid and (peer.role, peer.rank) == (exc.role, exc.rank):
                out += self._down(r, f"transfer[{r}] pid {exc.pid} died")
        return out

    def check(self) -> list[CopyResult]:
        """Failed results for tasks of dead or replaced ranks and tasks past
        ``spec.task_timeout_s``; adopts restarted processes. Cheap when nothing is due:
        call it on every inbox timeout and at least once per engine step."""
        out = self._take_ready()
        now = time.monotonic()
        liveness = now >= self._next_liveness  # /proc reads at most once per heartbeat
        if liveness:
            self._next_liveness = now + self.spec.heartbeat_s
        for r in range(self.tp):
            out += self._refresh(r, liveness)
        out += self._expire(now)
        return out + self._take_ready()

    # -- ranks -------------------------------------------------------------------------
    def _refresh(self, r: int, liveness: bool = False) -> list[CopyResult]:
        """Notices a replaced (or, with ``liveness``, dead) owner; adopts a new process."""
        st, out = self._ranks[r], []
        if st.owner is not None:
            bound = self.ends.tasks[r].ring.peer_id(Side.CONSUMER)
            if bound != (st.owner.pid, st.owner.started):
                out = self._down(r, f"transfer[{r}] pid {st.owner.pid} died (replaced by pid {bound[0]})")
            elif liveness and not st.owner.alive():
                out = self._down(r, f"transfer[{r}] pid {st.owner.pid} died")
        if st.owner is None:
            self._try_adopt(r)
        return out

    def _try_adopt(self, r: int) -> bool:
        st = self._ranks[r]
        task, done = self.ends.tasks[r], self.ends.dones[r]
        peer = task.ring.peer(Side.CONSUMER)
        if not peer.pid or peer == st.dead:
            return False
        if done.ring.peer(Side.PRODUCER)[2:] != peer[2:]:
            return False  # binding its ends right now: next time
        if not peer.alive():
            st.dead = peer
            return False
        self._discard_leftovers(r)
        try:
            task.send(fence_for(peer, self.weights_version), timeout=0)
        except (PeerTimeout, PeerDied, ChannelClosed) as exc:
            log.warning("transfer[%d]: cannot fence pid %d yet: %s", r, peer.pid, exc)
            return False
        st.owner, st.why = peer, ""
        self._gather.revive(r)
        if not st.listening:
            self.ends.inbox.add(done)
            st.listening = True
        log.info("transfer[%d]: adopted pid %d", r, peer.pid)
        self._send_redo(r)
        return True

    def _discard_leftovers(self, r: int) -> None:
        """Acks a predecessor left in ``done.{r}``: every one is for a task failed at its
        death. Its successor writes only after its fence, so none of these is its own."""
        done = self.ends.dones[r]
        while True:
            try:
                n = len(done.try_recv_many())
            except BadMessage:
                n = 1
            if not n:
                return
            self.stale += n

    def _down(self, r: int, why: str) -> list[CopyResult]:
        st = self._ranks[r]
        self._check_landed(r, why)
        why = st.hung or why  # a killed process's death: the timeout is what its tasks failed of
        if st.owner is not None:
            st.dead, st.owner = st.owner, None
            log.warning("%s: failing its pending tasks", why)
        st.why, st.hung = why, ""
        if st.listening:
            self.ends.inbox.remove(self.ends.dones[r])
            st.listening = False
        return [self._finish(t) for t in self._gather.fail_rank(r, why)]

    def _check_landed(self, r: int, why: str) -> None:
        """A rank going down leaves the layered copies it acked and did not land: its successor
        copies them again before anything else (``_redo``); until then the steps that hold their
        blocks wait on that rank (``fastkv.transfer.landing``)."""
        torn = self.landing.torn(r)
        if torn:
            log.warning("transfer[%d] went down (%s) with layered copies %s landing: its successor redoes them",
                        r, why, [n for n, _, _ in torn])
            known = {n for n, _, _ in self._redo.get(r, [])}
            self._redo.setdefault(r, []).extend(t for t in torn if t[0] not in known)

    def _send_redo(self, r: int) -> None:
        """The torn layered copies of rank ``r``, to its successor right after its fence."""
        for n, src, dst in self._redo.pop(r, []):
            task_id, self._next_redo_id = self._next_redo_id, self._next_redo_id - 1
            self._redo_ids[task_id] = (r, n)
            try:
                self.ends.tasks[r].send(TaskMsg(task_id, int(CopyKind.SWAP_IN), src, dst, (), n), timeout=0)
            except (PeerTimeout, PeerDied, ChannelClosed) as exc:
                raise RuntimeError(f"transfer[{r}]: cannot redo layered copy {n} its predecessor left half done: "
                                   f"{exc}") from exc

    def _redone(self, msg: DoneMsg) -> None:
        r, n = self._redo_ids.pop(msg.task_id)
        if not msg.ok:  # its device blocks hold half a copy that steps may read: nothing can make them right
            raise RuntimeError(f"transfer[{r}]: layered copy {n}, redone after its process died, failed: {msg.error}")

    def _ack_failed(self, task_id: int, r: int, why: str) -> None:
        done = self._gather.add(DoneMsg(task_id, r, False, error=why))
        if done is not None:
            self._ready.append(self._finish(done))

    def _expire(self, now: float) -> list[CopyResult]:
        out: list[CopyResult] = []
        limit = self.spec.task_timeout_s
        for task_id, (_, t0) in list(self._plans.items()):
            if now - t0 < limit:
                break  # submit order: the rest are younger
            if task_id not in self._plans:
                continue  # completed by a kill below
            for r in self._gather.missing(task_id):
                st = self._ranks[r]
                assert st.owner is not None, f"task {task_id} waits on rank {r}, which is down"
                if st.hung:
                    continue  # being killed: the liveness check takes it down once it is gone
                st.hung = (f"transfer[{r}] pid {st.owner.pid} did not finish task {task_id} within {limit} s"
                           + (" (killed)" if self.kill_late else ""))
                if self._kill(st.owner):
                    out += self._down(r, st.hung)
                else:
                    log.error("%s and is not gone yet: its tasks stay in flight until it is", st.hung)
        return out

    def _kill(self, peer: Peer) -> bool:
        """SIGKILLs a hung transfer process (when ``kill_late``); True once it is gone,
        waiting on its pidfd for at most ``heartbeat_s``."""
        if not peer.alive():  # alive() checks the start time: never a reused pid
            return True
        if not self.kill_late:
            return False
        assert peer.pid != os.getpid(), "the engine owns a transfer rank's ends itself: refusing to kill itself"
        try:
            fd = os.pidfd_open(peer.pid)
        except ProcessLookupError:
            return True
        try:
            if not peer.alive():  # the pid was reused before the open: the fd is another process's
                return True
            signal.pidfd_send_signal(fd, signal.SIGKILL)
            gone, _, _ = select.select([fd], [], [], self.spec.heartbeat_s)
            return bool(gone) or not peer.alive()
        except PermissionError as exc:
            log.error("cannot kill hung %s: %s", peer.describe(), exc)
            return False
        finally:
            os.close(fd)

    # -- results -----------------------------------------------------------------------
    def _finish(self, done: TaskResult) -> CopyResult:
        plan, _ = self._plans.pop(done.task_id)
        layered = self.landing.on_complete(done.task_id)
        if plan.kind in STORAGE_KINDS:
            self._storage_pending -= 1
            self._spin_for_acks()
        return CopyResult(plan, done.ok, done.error, done.nbytes, done.seconds, layered)

    def _spin_for_acks(self) -> None:
        """The engine's inbox spins before it sleeps (``fastkv.ipc.doorbell``) only while no
        storage task is in flight: a rank's storage lane is a low-priority thread that a spinning
        engine would keep off a core, on a machine with few."""
        self.ends.inbox.bell.spin.enabled = not self._storage_pending

    def _take_ready(self) -> list[CopyResult]:
        out, self._ready = self._ready, []
        return out

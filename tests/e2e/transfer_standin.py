"""Stand-ins for the transfer layer (process and engine-side client), with the SEAMS.md
interface, used by the end-to-end tests until ``fastkv.transfer.process`` and
``fastkv.transfer.client`` exist (``launch.py`` prefers the real ones).

Stale tasks. A killed process leaves the tasks it had not taken in its ring; the client
fails every task pending on that process, so they must never run. A stand-in process drops
whatever is in its task ring, then publishes its pid and ``ready``; the client sends a
rank's tasks only to the process it adopted (alive, bound to the ring, pid and ready
published) and fails them at once while there is none. So whatever a new process finds
queued was sent to its predecessor. The launcher starts the engine only once every
transfer process is ready.
"""
from __future__ import annotations

import os
import time
from typing import NamedTuple

from fastkv import ops
from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.ipc import ChannelClosed, DoneMsg, Namespace, Peer, PeerDied, Side, TaskMsg
from fastkv.run import EngineEnds, RunSpec, attach_transfer
from fastkv.storage import namespace_fingerprint, open_store
from fastkv.transfer.tiers import DeviceTier, HostTier


class CopyResult(NamedTuple):
    plan: CopyPlan
    ok: bool
    error: str
    nbytes: int
    seconds: float


class StandinClient:
    def __init__(self, ends: EngineEnds, spec: RunSpec) -> None:
        self.ends, self.spec = ends, spec
        self.tp = spec.tp_size
        # task id -> [plan, submitted at, {rank: (ok, error, nbytes, seconds)}, owner Peer per rank (or None)]
        self._tasks: dict[int, list] = {}
        self._owner: list[Peer | None] = [None] * self.tp  # the adopted process of each rank

    @property
    def pending(self) -> int:
        return len(self._tasks)

    def _adopt(self, r: int) -> Peer | None:
        """Rank r's process if it may be sent tasks now: the adopted one while it lives, else
        a new one once it has dropped its predecessor's tasks and said ready."""
        owner = self._owner[r]
        current = self.ends.tasks[r].ring.peer(Side.CONSUMER)
        if owner is not None and current == owner and owner.alive():
            return owner
        sig = self.ends.signals
        if current.pid and current.alive() and sig[f"transfer{r}.pid"] == current.pid and sig[f"transfer{r}.ready"]:
            self._owner[r] = current
            return current
        self._owner[r] = None
        return None

    def submit(self, plan: CopyPlan) -> None:
        msg = TaskMsg.from_plan(plan)
        acks: dict[int, tuple] = {}
        owners = [self._adopt(r) for r in range(self.tp)]
        self._tasks[plan.plan_id] = [plan, time.monotonic(), acks, owners]
        for r, owner in enumerate(owners):
            if owner is None:
                acks[r] = (False, f"rank {r}: no live transfer process", 0, 0.0)
            else:
                self.ends.tasks[r].send(msg, timeout=self.spec.dead_after_s)

    def on_done(self, msg: DoneMsg) -> list[CopyResult]:
        task = self._tasks.get(msg.task_id)
        if task is None or msg.rank in task[2]:
            return []  # an ack for a task already failed (its rank died meanwhile)
        task[2][msg.rank] = (msg.ok, msg.error, msg.nbytes, msg.seconds)
        return self._complete([msg.task_id])

    def on_peer_died(self, exc: PeerDied) -> list[CopyResult]:
        return self.check()

    def check(self) -> list[CopyResult]:
        now = time.monotonic()
        for _plan, t, acks, owners in self._tasks.values():
            for r, owner in enumerate(owners):
                # The process the task was sent to is dead (or replaced): it will never answer.
                if r not in acks and (not owner.alive() or self.ends.tasks[r].ring.peer(Side.CONSUMER) != owner):
                    acks[r] = (False, f"rank {r}: transfer pid {owner.pid} is gone", 0, 0.0)
            if now - t > self.spec.task_timeout_s:
                for r in range(self.tp):
                    acks.setdefault(r, (False, f"rank {r}: no answer in {self.spec.task_timeout_s} s", 0, 0.0))
        return self._complete(list(self._tasks))

    def _complete(self, ids: list[int]) -> list[CopyResult]:
        out = []
        for tid in ids:
            plan, _t, acks, _owners = self._tasks[tid]
            if len(acks) < self.tp:
                continue
            del self._tasks[tid]
            errors = [a[1] or f"rank {r} failed" for r, a in sorted(acks.items()) if not a[0]]
            out.append(CopyResult(plan, not errors, "; ".join(errors), sum(a[2] for a in acks.values()),
                                  max(a[3] for a in acks.values())))
        return out


def _execute(msg: TaskMsg, dev: DeviceTier, host: HostTier | None, store, threads: int) -> tuple[bool, str, int]:
    kind, n = CopyKind(msg.kind), max(len(msg.src), len(msg.dst))
    nbytes = n * dev.layout.block_bytes
    if kind is CopyKind.SWAP_OUT:
        ops.swap_out(dev.k, dev.v, host.tensor, msg.src, msg.dst, num_threads=threads)
    elif kind is CopyKind.SWAP_IN:
        ops.swap_in(dev.k, dev.v, host.tensor, msg.src, msg.dst, num_threads=threads)
    elif kind is CopyKind.STORE:
        if store is None or not all(store.put(list(msg.keys), host.array, msg.src)):
            return False, "store failed", 0
    elif kind is CopyKind.LOAD:
        if store is None or not all(store.get(list(msg.keys), host.array, msg.dst)):
            return False, "load missed", 0
    else:
        nbytes = 0  # CLEAR / RESTORE: nothing held per block in this stand-in
    return True, "", nbytes


def main(spec_json: str, rank: int) -> int:
    spec = RunSpec.from_json(spec_json)
    me = f"transfer{rank}"
    ns = Namespace.attach(spec.run_id)
    ends = attach_transfer(ns, spec, rank)
    sig = ends.signals
    sig[f"{me}.ready"] = 0  # a SIGKILLed predecessor left its flag set
    sig[f"{me}.pid"] = os.getpid()
    sig[f"{me}.beat"] = time.monotonic_ns()
    dev = DeviceTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks)
    host = HostTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_host_blocks, pin=False) \
        if spec.num_host_blocks else None
    store = None
    if spec.storage_url:
        fp = namespace_fingerprint(spec.model_id, spec.weights_version, spec.layout.describe())
        store = open_store(spec.storage_url, fp, rank, spec.tp_size)
    while ends.task.try_recv_many(256):
        continue  # sent to a dead predecessor: the client has failed them
    sig[f"{me}.ready"] = 1
    try:
        while not sig["stop"]:
            sig[f"{me}.beat"] = time.monotonic_ns()
            try:
                for msg in ends.task.recv_many(64, timeout=spec.heartbeat_s):
                    t0 = time.perf_counter()
                    try:
                        ok, err, nbytes = _execute(msg, dev, host, store, spec.ops_threads)
                    except (ValueError, TypeError) as exc:
                        ok, err, nbytes = False, f"{type(exc).__name__}: {exc}", 0
                    ends.done.send(DoneMsg(msg.task_id, rank, ok, nbytes, time.perf_counter() - t0, err),
                                   timeout=spec.dead_after_s)
            except (ChannelClosed, PeerDied):
                return 0  # the engine is gone
        return 0
    finally:
        sig[f"{me}.ready"] = 0
        if store is not None:
            store.close()
        ends.close()

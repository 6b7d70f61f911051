"""Executes copy tasks on one rank's KV tiers and storage backend (the transfer process's body).

| task     | moves                                         | acknowledged ok when                    |
|----------|-----------------------------------------------|-----------------------------------------|
| SWAP_OUT | device blocks ``src`` -> host blocks ``dst``  | the op returned (bytes in place)        |
| SWAP_IN  | host blocks ``src`` -> device blocks ``dst``  | every ``src`` passed its checksum       |
| STORE    | host blocks ``src`` -> storage ``keys``       | every block passed its checksum and     |
|          |                                               | was written                             |
| LOAD     | storage ``keys`` -> host blocks ``dst``       | every block was found and verified      |
| CLEAR    | nothing: quiesce for a weight update          | always (idempotent)                     |
| RESTORE  | nothing: new weights version in ``keys[0]``   | the device tier re-attached             |

A task that fails (bad ids, a storage miss, anything raised) is acknowledged with
``ok=False`` and the exception's text; the executor stays usable for the next task.

Progress. A swap, STORE or LOAD runs in parts and calls ``progress()`` (the process's
heartbeat) after each, so a long task on slow but live storage never looks like a dead
process. Parts start at one block and double while a part takes under
``spec.heartbeat_s / 2`` (halving when slower): a fast tier soon moves large batches, a
slow one beats about every heartbeat as long as one block is quicker than that.

Host checksums (``spec.host_checksums``, default on). A block that lands in the host tier
(SWAP_OUT, LOAD) gets an xxh3-128 of its bytes beside it (``HostTier.seal``); SWAP_IN and
STORE recheck them (STORE before writing: storage never gets bad bytes under a good
checksum). Host memory that changed meanwhile fails the task: the engine treats it like any
failed copy (the request recomputes from that block; a failed STORE leaves storage without
the key). ``checksum_mismatches``
counts the bad blocks (the transfer loop publishes it to the run's signals).

Weight updates. The engine sends CLEAR once no request and no copy is left (the cache
core refuses ``begin_weight_update`` otherwise), then reloads weights, then RESTORE.

* CLEAR: a rank executes its tasks in order, so its CLEAR ack means every earlier task of
  that rank has finished; CLEAR acked by every rank = no copy in flight anywhere. The
  executor then refuses every task but RESTORE (no STORE/LOAD can reach the storage tier
  under the old namespace), closes its storage backend and drops its mapping of the device
  tier. It frees nothing itself: the tiers belong to their creators. On a CPU build the
  device tier is a shm segment the supervisor owns, and "clearing the caches" only means
  their contents are dead (the engine dropped every cached key; nothing references a
  block); nothing is worth zeroing. On a GPU build the worker owns the device tensors and
  this process holds CUDA IPC mappings of them: dropping those is what lets the worker
  really free the GPU memory for the new weights (FastDeploy frees its caches there).
  The host tier stays mapped (and pinned): it is host memory, outlives any process, and
  the engine decides which of its blocks are garbage.
* RESTORE: ``keys[0]`` is the new weights version (UTF-8). The executor re-attaches the
  device tier (the worker may have re-allocated it) and reopens the storage backend under
  ``storage_namespace(spec, version)``: values written under the old weights fail
  verification (a miss), never load as KV of the new ones. RESTORE also works without a
  preceding CLEAR (a plain version switch).
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable

import numpy as np

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.ipc import DoneMsg, TaskMsg
from fastkv.run import RunSpec
from fastkv.storage import StorageBackend, open_store
from fastkv.transfer.protocol import storage_namespace, task_plan
from fastkv.transfer.tiers import DeviceTier, HostTier

log = logging.getLogger(__name__)


class TaskRefused(RuntimeError):
    """The executor's state does not allow this task now (cleared, no tier, no storage)."""


class CorruptHostBlock(RuntimeError):
    """A host block's bytes no longer match the checksum written when they landed."""


class TaskExecutor:
    """One rank's tiers and storage backend, and the code that runs each task on them."""

    def __init__(self, spec: RunSpec, rank: int) -> None:
        if not isinstance(rank, int) or not 0 <= rank < spec.tp_size:
            raise ValueError(f"rank must be an int in [0, {spec.tp_size}), got {rank!r}")
        self.spec, self.rank = spec, rank
        self.block_bytes = spec.layout.block_bytes
        self.weights_version = spec.weights_version
        self.device: DeviceTier | None = None
        self.host: HostTier | None = None
        self._bound = None  # ops.BoundSwap over the tiers, made on the first swap after they attach
        self.store: StorageBackend | None = None
        self.store_error = ""  # why there is no storage backend (empty: none configured, or open)
        self._faults = [0, 0]  # storage errors, corrupt values since the last take_faults()
        self.cleared = False
        self._progress: Callable[[], None] = lambda: None  # of the task running now
        self.checksum_mismatches = 0
        try:
            self._attach_device()
            if spec.num_host_blocks:
                self.host = HostTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_host_blocks)
            self._open_store()
        except BaseException:
            self.close()
            raise

    # -- lifetime ----------------------------------------------------------------------
    def _attach_device(self) -> None:
        self._drop_device()
        self.device = DeviceTier.attach(self.spec.tier_prefix, self.rank, self.spec.layout,
                                        self.spec.num_device_blocks)

    def _drop_device(self) -> None:
        self._bound = None  # before the mapping it points into goes
        if self.device is not None:
            self.device.close()
            self.device = None

    def _open_store(self) -> None:
        self._close_store()
        if not self.spec.storage_url:
            return
        namespace = storage_namespace(self.spec, self.weights_version)
        try:
            self.store = open_store(self.spec.storage_url, namespace, self.rank, self.spec.tp_size)
        except Exception as exc:  # degrade: STORE/LOAD fail with this text, swaps go on
            self.store_error = f"storage tier {self.spec.storage_url!r} unavailable: {type(exc).__name__}: {exc}"
            log.error("transfer[%d]: %s", self.rank, self.store_error)

    def _close_store(self) -> None:
        if self.store is not None:
            self.store.close()
        self.store, self.store_error = None, ""

    def adopt_weights(self, version: str) -> None:
        """Serve ``version`` (the engine's current one, from this process's fence): a
        process started after a weight update reopens storage under it."""
        if version != self.weights_version:
            self.weights_version = version
            self._open_store()

    def close(self) -> None:
        """Closes the storage backend and drops this process's tier mappings."""
        self._close_store()
        self._drop_device()
        if self.host is not None:
            self.host.close()
        self.host = None

    # -- tasks -------------------------------------------------------------------------
    def run(self, msg: TaskMsg, progress: Callable[[], None] = lambda: None) -> DoneMsg:
        """Executes one task, calling ``progress()`` as its parts complete; never raises
        for a bad or failed task."""
        t0 = time.perf_counter()
        self._progress = progress
        try:
            nbytes, error = self._run(msg)
        except Exception as exc:  # the task fails alone; reported to the engine, never swallowed
            nbytes, error = 0, f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ValueError | TypeError | TaskRefused | CorruptHostBlock):
                log.exception("transfer[%d]: task %d (kind %d) raised", self.rank, msg.task_id, msg.kind)
        return DoneMsg(msg.task_id, self.rank, not error, nbytes, time.perf_counter() - t0, error)

    def _run(self, msg: TaskMsg) -> tuple[int, str]:
        try:
            kind = CopyKind(msg.kind)
        except ValueError:
            raise ValueError(f"unknown task kind {msg.kind}") from None
        plan = task_plan(msg)  # CopyPlan checks src/dst/keys counts
        if kind is CopyKind.CLEAR:
            return self._clear()
        if kind is CopyKind.RESTORE:
            return self._restore(plan)
        if self.cleared:
            raise TaskRefused(f"{kind.name} refused: caches cleared for a weight update (weights version "
                              f"{self.weights_version!r}); waiting for RESTORE")
        if kind is CopyKind.SWAP_OUT or kind is CopyKind.SWAP_IN:
            return self._swap(plan)
        return self._storage(plan)

    def _swap(self, plan: CopyPlan) -> tuple[int, str]:
        device, host = self.device, self.host
        if host is None:
            raise TaskRefused(f"{plan.kind.name} refused: this run has no host tier (num_host_blocks=0)")
        assert device is not None, "executor not cleared but without a device tier"
        ndev, nhost = self.spec.num_device_blocks, self.spec.num_host_blocks
        out = plan.kind is CopyKind.SWAP_OUT
        self._check_ids(plan.src, ndev if out else nhost, "src")
        self._check_ids(plan.dst, nhost if out else ndev, "dst")
        if len(np.unique(plan.dst)) != len(plan.dst):
            raise ValueError(f"{plan.kind.name} dst block ids must be unique, got {plan.dst.tolist()[:16]}")
        if not out:  # the ids are sound: host bytes that changed since they landed never reach the device
            self._check_host(plan.src.tolist())
        if self._bound is None:
            from fastkv import ops

            self._bound = ops.BoundSwap(device.k, device.v, host.tensor)
        swap, threads = self._bound.swap, self.spec.ops_threads
        self._in_parts(len(plan.src), lambda part: swap(plan.src[part], plan.dst[part], to_host=out,
                                                        num_threads=threads))
        if out and self.spec.host_checksums:
            host.seal(plan.dst.tolist())
        return len(plan.src) * self.block_bytes, ""

    def take_faults(self) -> tuple[int, int]:
        """Storage errors and corrupt values since the last call (the engine's summary counts them)."""
        faults, self._faults = tuple(self._faults), [0, 0]
        return faults

    def _check_host(self, blocks: list[int]) -> None:
        """CorruptHostBlock naming the blocks whose bytes changed since they landed."""
        if not self.spec.host_checksums:
            return
        bad = self.host.corrupt(blocks)
        if bad:
            self.checksum_mismatches += len(bad)
            log.error("transfer[%d]: host blocks %s changed since they landed (checksum mismatch)", self.rank, bad)
            raise CorruptHostBlock(f"host checksum mismatch: host blocks {bad} changed since they landed")

    def _storage(self, plan: CopyPlan) -> tuple[int, str]:
        if self.store is None:
            self._faults[0] += bool(self.store_error)  # configured but unavailable: a fault, not a setting
            raise TaskRefused(f"{plan.kind.name} refused: " + (self.store_error or "this run has no storage tier "
                                                                "(spec.storage_url is empty)"))
        if self.host is None:
            raise TaskRefused(f"{plan.kind.name} refused: this run has no host tier (num_host_blocks=0)")
        stats = self.store.stats
        before = stats.errors, stats.corrupt
        store, host, done = self.store, self.host.array, []
        self._check_ids(plan.src if plan.kind is CopyKind.STORE else plan.dst, self.spec.num_host_blocks, "host")
        if plan.kind is CopyKind.STORE:
            self._check_host(plan.src.tolist())
            verb, ids, move = "stored", plan.src, store.put
        else:
            verb, ids, move = "loaded", plan.dst, store.get
        self._in_parts(len(ids), lambda part: done.extend(move(plan.keys[part], host, ids[part])))
        self._faults[0] += stats.errors - before[0]
        self._faults[1] += stats.corrupt - before[1]
        if plan.kind is CopyKind.LOAD and self.spec.host_checksums:
            self.host.seal([int(b) for b, ok in zip(ids, done, strict=True) if ok])
        n_ok = sum(done)
        if n_ok == len(done):
            return n_ok * self.block_bytes, ""
        failed = [int(b) for b, ok in zip(ids, done, strict=True) if not ok]
        more = ", ..." if len(failed) > 8 else ""
        return n_ok * self.block_bytes, (f"{verb} {n_ok} of {len(done)} blocks; not {verb}: host blocks "
                                         f"{str(failed[:8])[:-1]}{more}]")

    @staticmethod
    def _check_ids(ids: np.ndarray, n: int, what: str) -> None:
        """Every id of the whole plan, before its first part copies anything."""
        bad = ids[(ids < 0) | (ids >= n)]
        if len(bad):
            raise ValueError(f"{what} block id {int(bad[0])} out of range [0, {n})")

    def _in_parts(self, n: int, step: Callable[[slice], None]) -> None:
        """``step`` over blocks [0, n) in parts, reporting progress after each (module docstring)."""
        target, size, i = self.spec.heartbeat_s / 2, 1, 0
        while i < n:
            t0 = time.monotonic()
            step(slice(i, i + size))
            self._progress()
            i += size
            size = size * 2 if time.monotonic() - t0 < target else max(1, size // 2)

    def _clear(self) -> tuple[int, str]:
        self._close_store()
        self._drop_device()
        self.cleared = True
        return 0, ""

    def _restore(self, plan: CopyPlan) -> tuple[int, str]:
        if not plan.keys:
            raise ValueError("RESTORE needs the new weights version in keys[0]")
        version = plan.keys[0].decode("utf-8")
        if not version:
            raise ValueError("RESTORE: the weights version in keys[0] is empty")
        self._clear()  # until this RESTORE succeeds, nothing runs under either version
        self._attach_device()  # raises (the task fails, still cleared) if the worker has not re-created it
        self.weights_version = version
        self._open_store()
        self.cleared = False
        return 0, ""

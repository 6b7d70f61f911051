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
| LOOKUP   | nothing: which ``keys`` storage holds; the ack | the store answered (``found``: per key  |
|          | carries them (``fastkv.storage.lookup``)      | chain in ``src``, its present prefix)   |

A task that fails (bad ids, a storage miss, anything raised) is acknowledged with
``ok=False`` and the exception's text; the executor stays usable for the next task.

Lanes. The transfer process runs swaps and storage tasks side by side
(``fastkv.transfer.lanes``): ``run`` is called from two threads, each with its own
``progress``; a storage task passes the ``Hold`` on its host blocks, released part by
part, and a swap waits, part by part, until ``holds`` has no storage task in its way on
its host blocks (a LOAD filling what it reads, any task on what it writes). So a SWAP_IN
checks its host checksums per part (after that wait), and a block a LOAD failed to fill is
unsealed: its stale bytes fail a SWAP_IN or STORE that reads it.

Progress. A swap, STORE or LOAD runs in parts and calls ``progress()`` (the process's
heartbeat) after each, so a long task on slow but live storage never looks like a dead
process. Parts start at one block and double while a part takes under
``spec.heartbeat_s / 2`` (halving when slower): a fast tier soon moves large batches, a
slow one beats about every heartbeat as long as one block is quicker than that. A swap's
parts stay under ``SWAP_PART_S``: it copies holding the GIL (``fastkv.transfer.lanes``), so
the storage lane's LOOKUPs (``storage_lookup_timeout_s``, 0.2 s by default), LOADs and acks
wait for the GIL no longer than one part.

Host checksums (``spec.host_checksums``, default on). A block that lands in the host tier
(SWAP_OUT, LOAD) gets a checksum of its bytes beside it (``tiers.block_checksum``: xxh3 per
page; a CPU SWAP_OUT's in the same pass over each page's bytes as its copy); SWAP_IN and
STORE recheck them (STORE before writing: storage never gets bad bytes under a good
checksum). Host memory that changed meanwhile fails the task: the engine treats it like any
failed copy (the request recomputes from that block; a failed STORE leaves storage without
the key). ``checksum_mismatches``
counts the bad blocks (the transfer loop publishes it to the run's signals).

MLA (``layout.mla``). The latent is the same on every rank, so the storage tier holds it once:
every rank opens the store as the one shard of rank 0 of 1, rank 0 writes each value and the
other ranks acknowledge a STORE without writing; LOADs run on every rank, each reading the
same value into its own host tier. The storage bytes per token do not grow with tp.

Weight updates. The engine sends CLEAR once no request and no copy is left (the cache
core refuses ``begin_weight_update`` otherwise), then has the workers load the new weights,
then sends RESTORE.

* CLEAR: a barrier across a rank's lanes (``fastkv.transfer.lanes``): it runs once every
  earlier task of that rank has finished, so its ack means none is left; CLEAR acked by
  every rank = no copy in flight anywhere. The
  executor then refuses every task but RESTORE (no STORE/LOAD can reach the storage tier
  under the old namespace), closes its storage backend and drops its mapping of the device
  tier: on a GPU build the worker owns the device tensors and this process holds CUDA IPC
  mappings of them, and dropping those is what lets the worker really free the GPU memory
  for the new weights (FastDeploy frees its caches there). The engine dropped every cached
  key, so the contents of both tiers are dead. ``ClearTask.free_memory`` (the engine's
  ``free_memory``; ``keys == (b"free",)`` on the wire): the host tier's memory goes back to
  the OS too (``HostTier.release``, unpinned first; FastDeploy's
  FD_ENABLE_SWAP_SPACE_CLEARING); without it the host tier stays mapped and pinned, ready
  for the next swap.
* RESTORE: ``RestoreTask.weights_version`` (``keys[0]``, UTF-8, on the wire). The executor
  re-attaches the device tier (the worker may have re-allocated it) and the host tier
  (pinning it again), and reopens the storage backend under ``storage_namespace(spec, version)``: values
  written under the old weights fail verification (a miss), never load as KV of the new
  ones. RESTORE also works without a preceding CLEAR (a plain version switch).
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from fastkv.cache.plan import CopyKind, CopyPlan, LookupTask, RestoreTask
from fastkv.ipc import DoneMsg, TaskMsg
from fastkv.run import RunSpec
from fastkv.storage import StorageBackend, open_store
from fastkv.storage.lookup import found_prefixes
from fastkv.transfer.group_swaps import GroupSwaps
from fastkv.transfer.lanes import Hold, HostHolds
from fastkv.transfer.protocol import storage_namespace, task_plan
from fastkv.transfer.tiers import DeviceTier, HostTier, resident_bytes

log = logging.getLogger(__name__)
SWAP_PART_S = 0.01  # the longest a swap's part grows to: it holds the GIL meanwhile (module docstring)


class TaskRefused(RuntimeError):
    """The executor's state does not allow this task now (cleared, no tier, no storage)."""


class CorruptHostBlock(RuntimeError):
    """A host block's bytes no longer match the checksum written when they landed."""


def storage_time_model(spec: RunSpec) -> Callable[[int], float] | None:
    """Under the synthetic runner's cost model, the least seconds a STORE or LOAD of so many bytes
    takes: the deployment's storage link, scaled like its copies
    (``fastkv.deploy.cost_model.ScaledCostModel.storage_seconds``); None otherwise."""
    from fastkv.deploy.cost_model import scaled_for

    model = scaled_for(spec.runner, spec.runner_options, spec.layout)
    return None if model is None else model.storage_seconds


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
        self.groups: GroupSwaps | None = None  # a hybrid's host tier: a segment per KV cache group
        self._bound = None  # ops.BoundSwap over the tiers, made on the first swap after they attach
        self.store: StorageBackend | None = None
        self.store_error = ""  # why there is no storage backend (empty: none configured, or open)
        self._faults = [0, 0]  # storage errors, corrupt values since the last take_faults()
        self._counting = threading.Lock()  # both lanes count faults and mismatches
        self.cleared = False
        self._task = threading.local()  # progress() of the task each lane is running
        self.holds = HostHolds()  # host blocks storage tasks are on (fastkv.transfer.lanes)
        self.checksum_mismatches = 0
        self.released_bytes = 0  # host tier memory given back by CLEAR with FREE
        self._storage_s = storage_time_model(spec)  # None: storage I/O at this machine's speed
        self._closing = threading.Event()  # cuts a modelled storage wait short at close
        self.landed = None  # fastkv.ipc.landed.Landed of this rank: set by the process, for layered SWAP_INs
        try:
            self._attach_device()
            self._attach_host()
            self._open_store()
        except BaseException:
            self.close()
            raise

    # -- lifetime ----------------------------------------------------------------------
    def _attach_device(self) -> None:
        self._drop_device()
        self.device = DeviceTier.attach(self.spec.tier_prefix, self.rank, self.spec.layout,
                                        self.spec.num_device_blocks, populate=True,
                                        layer_blocks=self.spec.layer_blocks())

    def _drop_device(self) -> None:
        self._bound = None  # before the mapping it points into goes
        if self.groups is not None:
            self.groups.unbind()
        if self.device is not None:
            self.device.close()
            self.device = None

    def _attach_host(self) -> None:
        self._bound = None  # it points into the host mapping too
        if self.host is not None:
            self.host.close()
            self.host = None
        if self.groups is not None:
            self.groups.close()
            self.groups = None
        if self.spec.host_group_blocks():
            self.groups = GroupSwaps(self.spec, self.rank)
        elif self.spec.num_host_blocks:
            self.host = HostTier.attach(self.spec.tier_prefix, self.rank, self.spec.layout, self.spec.num_host_blocks,
                                        populate=True)

    def _open_store(self) -> None:
        self._close_store()
        if not self.spec.storage_url:
            return
        namespace = storage_namespace(self.spec, self.weights_version)
        shard, shards = (0, 1) if self.spec.layout.mla else (self.rank, self.spec.tp_size)
        try:
            self.store = open_store(self.spec.storage_url, namespace, shard, shards)
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
        self._closing.set()
        self._close_store()
        self._drop_device()
        if self.host is not None:
            self.host.close()
        self.host = None
        if self.groups is not None:
            self.groups.close()
            self.groups = None

    # -- tasks -------------------------------------------------------------------------
    def run(self, msg: TaskMsg, progress: Callable[[], None] = lambda: None, hold: Hold | None = None,
            early: Callable[[DoneMsg], None] | None = None) -> DoneMsg | None:
        """Executes one task, calling ``progress()`` as its parts complete; never raises
        for a bad or failed task. ``hold``: the host blocks a storage task was dispatched
        on, released part by part and all at the end. ``early``: a layered SWAP_IN
        (``msg.layered``) is acked through it once verified, then copied layer by layer, and
        None is returned (``_layered``)."""
        if msg.layered and early is not None and msg.kind == CopyKind.SWAP_IN and self.landed is not None:
            return self._layered(msg, progress, early)
        t0 = time.perf_counter()
        task = self._task
        outer = getattr(task, "progress", None), getattr(task, "hold", None)  # a LOOKUP run between parts
        task.progress, task.hold = progress, hold
        found = None
        try:
            if msg.kind == CopyKind.LOOKUP:
                found, nbytes, error = self._lookup(task_plan(msg)), 0, ""
            else:
                nbytes, error = self._run(msg)
        except Exception as exc:  # the task fails alone; reported to the engine, never swallowed
            nbytes, error = 0, f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ValueError | TypeError | TaskRefused | CorruptHostBlock):
                log.exception("transfer[%d]: task %d (kind %d) raised", self.rank, msg.task_id, msg.kind)
        finally:
            if hold is not None:
                hold.release()
            task.progress, task.hold = outer
        done = DoneMsg(msg.task_id, self.rank, not error, nbytes, time.perf_counter() - t0, error)
        if found is not None and not error:
            done.found = found.astype(np.int32).tobytes()
        return done

    def _lookup(self, plan: LookupTask) -> np.ndarray:
        if self.cleared or self.store is None:
            raise TaskRefused("LOOKUP refused: " + (self.store_error or "no storage tier open (not configured, "
                                                    "or cleared for a weight update)"))
        stats = self.store.stats
        with self._faults_of(self.store):
            failed = stats.errors + stats.skipped
            found = found_prefixes(self.store, plan.keys, plan.chain_lengths)
            if stats.errors + stats.skipped > failed:  # a backend answers all-miss when down: not an answer
                raise TaskRefused("LOOKUP failed: the storage tier is down (its error is in this log)")
        return found

    def _run(self, msg: TaskMsg) -> tuple[int, str]:
        plan = task_plan(msg)  # each task type checks its fields
        kind = plan.kind
        if kind is CopyKind.CLEAR:
            return self._clear(free=plan.free_memory)
        if kind is CopyKind.RESTORE:
            return self._restore(plan)
        if self.cleared:
            raise TaskRefused(f"{kind.name} refused: caches cleared for a weight update (weights version "
                              f"{self.weights_version!r}); waiting for RESTORE")
        if kind is CopyKind.SWAP_OUT or kind is CopyKind.SWAP_IN:
            return self._swap(plan)
        return self._storage(plan)

    def _swap(self, plan: CopyPlan) -> tuple[int, str]:
        if plan.group >= 0 and self.groups is not None:  # a hybrid's: that group's layers (group_swaps.py)
            assert self.device is not None, "executor not cleared but without a device tier"
            return self.groups.swap(self.device, plan, threads=self.spec.ops_threads,
                                    checksums=self.spec.host_checksums,
                                    in_parts=lambda n, step: self._in_parts(n, step, SWAP_PART_S),
                                    check_ids=self._check_ids, check_host=self._check_host_of), ""
        device, host = self.device, self.host
        if host is None:
            raise TaskRefused(f"{plan.kind.name} refused: this run has no host tier (num_host_blocks=0)")
        assert device is not None, "executor not cleared but without a device tier"
        ndev, nhost = self.spec.num_device_blocks, self.spec.num_host_blocks
        out = plan.kind is CopyKind.SWAP_OUT
        self._check_ids(plan.src, ndev if out else nhost, "src")
        self._check_ids(plan.dst, nhost if out else ndev, "dst")
        if len(plan.dst) > 1 and len(np.unique(plan.dst)) != len(plan.dst):
            raise ValueError(f"{plan.kind.name} dst block ids must be unique, got {plan.dst.tolist()[:16]}")
        if self._bound is None:
            from fastkv.kernels import ops

            # swaps hold the GIL while they copy: the storage thread takes it only while the
            # swap lane sleeps (fastkv.transfer.lanes)
            self._bound = ops.BoundSwap(device.k, device.v, host.tensor, hold_gil=True)
        swap, threads = self._bound.swap, self.spec.ops_threads
        host_ids = plan.dst if out else plan.src

        sums = host.checksums if out and self.spec.host_checksums else None
        unsealed = []

        def part(p: slice) -> None:
            # storage tasks read before this one may still be on these host blocks (fastkv.transfer.lanes)
            self.holds.wait(host_ids[p], out, self._task.progress, self.spec.heartbeat_s)
            if not out:  # host bytes that changed since they landed never reach the device
                self._check_host(plan.src[p].tolist(), hold_gil=True)
            # a SWAP_OUT's checksums come from its pages in the copy's pass (ops/block_digest.h)
            if not swap(plan.src[p], plan.dst[p], to_host=out, num_threads=threads, sums=sums) and sums is not None:
                unsealed.extend(plan.dst[p].tolist())

        self._in_parts(len(plan.src), part, SWAP_PART_S)
        if unsealed:  # a swap that wrote no checksums: sealed from the host bytes
            host.seal(unsealed)
        return len(plan.src) * self.block_bytes, ""

    def _layered(self, msg: TaskMsg, progress: Callable[[], None], early: Callable[[DoneMsg], None]) -> None:
        """A SWAP_IN a step waits for, layer by layer (module docstring of ``fastkv.ipc.landed``).

        Everything that can fail is checked before the ack: ids, the storage tasks still on its
        host blocks, every host checksum. Then the ack goes out (the engine may plan the step at
        once) and the copy runs layer-major: layer 0 of every block, then layer 1, ..., each layer
        announced as it lands, so the step's layer l starts while layers > l are still copying.
        A host block is block-major (its layers are consecutive spans), so one layer of n blocks
        is n strided spans of one K and one V page each: pages of kilobytes, as cheap to gather as
        a contiguous run. Block-major order would land every layer of block 0 first, which no
        layer's attention can use before the last block has landed.

        This process's loop runs nothing else until the copy is done, so the host blocks the
        engine unpinned at the ack are not overwritten meanwhile (a later LOAD is dispatched only
        after it: ``fastkv.transfer.lanes``). On a CUDA device tier the copy is one swap and
        every layer is announced after it (no per-layer copy in the C ABI yet)."""
        t0 = time.perf_counter()
        task, landed = self._task, self.landed
        outer = getattr(task, "progress", None), getattr(task, "hold", None)
        task.progress, task.hold = progress, None
        plan = None
        try:
            plan = task_plan(msg)
            if self.cleared:
                raise TaskRefused(f"SWAP_IN refused: caches cleared for a weight update (weights version "
                                  f"{self.weights_version!r}); waiting for RESTORE")
            host, device = self.host, self.device
            if host is None:
                raise TaskRefused("SWAP_IN refused: this run has no host tier (num_host_blocks=0)")
            self._check_ids(plan.src, self.spec.num_host_blocks, "src")
            self._check_ids(plan.dst, self.spec.num_device_blocks, "dst")
            if len(plan.dst) > 1 and len(np.unique(plan.dst)) != len(plan.dst):
                raise ValueError(f"SWAP_IN dst block ids must be unique, got {plan.dst.tolist()[:16]}")
            self.holds.wait(plan.src, False, progress, self.spec.heartbeat_s)
            self._check_host(plan.src.tolist(), hold_gil=True)
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            if not isinstance(exc, ValueError | TypeError | TaskRefused | CorruptHostBlock):
                log.exception("transfer[%d]: layered task %d raised", self.rank, msg.task_id)
            landed.post(msg.layered, self.spec.layout.num_layers - 1)  # nothing of it lands: no step waits
            early(DoneMsg(msg.task_id, self.rank, False, 0, time.perf_counter() - t0, error))
            return None
        finally:
            task.progress, task.hold = outer
        nbytes = len(plan.src) * self.block_bytes
        early(DoneMsg(msg.task_id, self.rank, True, nbytes, time.perf_counter() - t0))
        layers = self.spec.layout.num_layers
        if self._bound is None:
            from fastkv.kernels import ops

            self._bound = ops.BoundSwap(device.k, device.v, host.tensor, hold_gil=True)
        if self._bound.on_gpu:  # CUDA: one swap, then every layer at once
            self._bound.swap(plan.src, plan.dst, to_host=False, num_threads=self.spec.ops_threads)
            landed.post(msg.layered, layers - 1)
            return None
        for layer in range(layers):
            if self.layer_delay is not None:
                self.layer_delay(msg.layered, layer)
            self._bound.swap_in_layer(plan.src, plan.dst, layer, self.spec.ops_threads)
            landed.post(msg.layered, layer)
            progress()
        return None

    # tests: called before each layer's copy (task, layer), to make one layer late
    layer_delay: Callable[[int, int], None] | None = None

    def take_faults(self) -> tuple[int, int]:
        """Storage errors and corrupt values since the last call (the engine's summary counts them)."""
        with self._counting:
            faults, self._faults = tuple(self._faults), [0, 0]
        return faults

    @contextmanager
    def _faults_of(self, store: StorageBackend) -> Iterator[None]:
        """Counts what ``store`` failed meanwhile: operations that failed on the server, or
        that a backoff after failures answered without it (a skipped STORE is a lost one)."""
        stats, task = store.stats, self._task
        before = stats.errors + stats.skipped, stats.corrupt
        depth = getattr(task, "faults_depth", 0)  # a LOOKUP run between a task's parts: counted by the task
        task.faults_depth = depth + 1
        try:
            yield
        finally:
            task.faults_depth = depth
            if not depth:
                self._count_faults(stats.errors + stats.skipped - before[0], stats.corrupt - before[1])

    def _count_faults(self, errors: int, corrupt: int) -> None:
        with self._counting:
            self._faults[0] += errors
            self._faults[1] += corrupt

    def _check_host(self, blocks: list[int], hold_gil: bool = False) -> None:
        """CorruptHostBlock naming the blocks whose bytes changed since they landed."""
        if self.spec.host_checksums:
            self._check_host_of(self.host, blocks, hold_gil)

    def _check_host_of(self, host: HostTier, blocks: list[int], hold_gil: bool = True) -> None:
        bad = host.corrupt(blocks, hold_gil)
        if bad:
            with self._counting:
                self.checksum_mismatches += len(bad)
            log.error("transfer[%d]: host blocks %s changed since they landed (checksum mismatch)", self.rank, bad)
            raise CorruptHostBlock(f"host checksum mismatch: host blocks {bad} changed since they landed")

    def _storage(self, plan: CopyPlan) -> tuple[int, str]:
        if self.store is None:
            self._count_faults(bool(self.store_error), 0)  # configured but unavailable: a fault, not a setting
            raise TaskRefused(f"{plan.kind.name} refused: " + (self.store_error or "this run has no storage tier "
                                                                "(spec.storage_url is empty)"))
        if self.host is None:
            raise TaskRefused(f"{plan.kind.name} refused: this run has no host tier (num_host_blocks=0)")
        store, host, done = self.store, self.host.array, []
        self._check_ids(plan.src if plan.kind is CopyKind.STORE else plan.dst, self.spec.num_host_blocks, "host")
        load = plan.kind is CopyKind.LOAD
        if not load and self.spec.layout.mla and self.rank != 0:
            return 0, ""  # rank 0 writes the latent every rank holds (module docstring)
        if load:
            verb, ids, move = "loaded", plan.dst, store.get
        else:
            self._check_host(plan.src.tolist())
            verb, ids, move = "stored", plan.src, store.put
        hold = self._task.hold

        def part(p: slice) -> None:
            t0 = time.perf_counter()
            oks = move(plan.keys[p], host, ids[p])
            if self._storage_s is not None:  # the deployment's storage link: its time, waited out
                self._closing.wait(max(0.0, t0 + self._storage_s(len(oks) * self.block_bytes) - time.perf_counter()))
            done.extend(oks)
            if load:  # sealed before a swap waiting for these blocks may read them
                self._landed(ids[p].tolist(), oks)
            if hold is not None:
                hold.release(ids[p].tolist())

        with self._faults_of(store):
            self._in_parts(len(ids), part)
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
        if len(ids) <= 1:  # numpy's fixed cost per call is most of a small task's (empty tasks too)
            if len(ids) and not 0 <= int(ids[0]) < n:
                raise ValueError(f"{what} block id {int(ids[0])} out of range [0, {n})")
            return
        bad = ids[(ids < 0) | (ids >= n)]
        if len(bad):
            raise ValueError(f"{what} block id {int(bad[0])} out of range [0, {n})")

    def _landed(self, blocks: list[int], oks: list[bool]) -> None:
        """Seals the loaded blocks; a block whose LOAD failed holds stale bytes under a
        checksum that still matches them: ``unseal`` it, so no SWAP_IN or STORE reads it."""
        if self.spec.host_checksums:
            self.host.seal([b for b, ok in zip(blocks, oks, strict=True) if ok])
            self.host.unseal([b for b, ok in zip(blocks, oks, strict=True) if not ok])

    def _in_parts(self, n: int, step: Callable[[slice], None], most_s: float | None = None) -> None:
        """``step`` over blocks [0, n) in parts, reporting progress after each; parts grow
        while they take under ``most_s`` (default half a heartbeat; module docstring)."""
        target = self.spec.heartbeat_s / 2 if most_s is None else min(most_s, self.spec.heartbeat_s / 2)
        size, i, progress = 1, 0, self._task.progress
        while i < n:
            t0 = time.monotonic()
            step(slice(i, i + size))
            progress()
            i += size
            size = size * 2 if time.monotonic() - t0 < target else max(1, size // 2)

    def _clear(self, free: bool = False) -> tuple[int, str]:
        self._close_store()
        self._drop_device()
        if free and self.host is not None:
            self.released_bytes += self.host.release() - resident_bytes(self.host.name)
        self.cleared = True
        return 0, ""

    def _restore(self, plan: RestoreTask) -> tuple[int, str]:
        version = plan.weights_version  # task_of refused a RESTORE without one
        self._clear()  # until this RESTORE succeeds, nothing runs under either version
        self._attach_device()  # raises (the task fails, still cleared) if the worker has not re-created it
        self._attach_host()  # pinned again if CLEAR released it
        self.weights_version = version
        self._open_store()
        self.cleared = False
        return 0, ""

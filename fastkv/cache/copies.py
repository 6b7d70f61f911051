"""The book of copies in flight: which plan moves what, for whom, and which keys it brings;
and the storage loads admissions share (below)."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import IntEnum
from typing import TYPE_CHECKING

from fastkv.cache.plan import ClearTask, CopyKind, CopyPlan, RestoreTask
from fastkv.cache.pool import BlockPool
from fastkv.cache.requests import CacheRecord

if TYPE_CHECKING:
    from fastkv.cache.state import CacheState


class Purpose(IntEnum):
    WRITE_BACK = 1  # SWAP_OUT of device victims to the host (their owner waits)
    WRITE_THROUGH = 2  # SWAP_OUT of full device blocks to the host (nobody waits)
    PREFIX_LOAD = 3  # LOAD of a prefix hit from storage into host staging blocks
    FILL = 4  # SWAP_IN into a request's table: a prefix hit's host blocks, or a restored request's
    OFFLOAD = 5  # SWAP_OUT of a preempted request's blocks
    STORE = 6  # STORE of host blocks to storage
    CONTROL = 7  # CLEAR / RESTORE around a weight update


@dataclass(slots=True, eq=False)
class CopyRecord:
    FIXED = ("plan", "purpose", "src", "dst", "keys", "positions")  # set at open, never rebound

    plan: CopyPlan | ClearTask | RestoreTask
    purpose: Purpose
    src: list[int]
    dst: list[int]
    keys: list[bytes]  # keys the destination blocks get on success (or the STORE / LOAD keys)
    req: CacheRecord | None
    positions: list[int] | None  # table positions a request's copy fills
    # PREFIX_LOAD: every request its blocks land for (its owner first), with plan index -> swap_src slot
    waiters: list[tuple[CacheRecord, dict[int, int]]] | None = None
    # WRITE_THROUGH: the request's chain of keys up to the plan's last one, root first
    chain: list[bytes] | None = None
    # WRITE_THROUGH: host blocks of the chain's earlier keys, held until it lands (see tiering.host_copies)
    held: list[int] | None = None
    # WRITE_THROUGH of a request that holds its chain (tiering.hold_chain): its landed blocks join that
    # hold; ``chain_end`` is its chain's length, for the per-plan hold it gets if the request lets go first
    owner: CacheRecord | None = None
    chain_end: int = 0
    # the parent keys of the keys it brings to the host: their host blocks wait for these children
    expected: list[bytes] | None = None

    def holds_chain(self, chain: list[bytes], held: list[int]) -> None:
        """WRITE_THROUGH of no request: it holds its chain's other host copies until it lands."""
        self.chain = chain
        self.held = held

    def owned_by(self, owner: CacheRecord, chain_end: int) -> None:
        """WRITE_THROUGH of a request holding its chain: its blocks join that hold as they land."""
        self.owner = owner
        self.chain_end = chain_end

    def orphaned(self, chain: list[bytes], held: list[int]) -> None:
        """WRITE_THROUGH whose owner let go of its chain hold: it holds its parents itself now."""
        self.owner = None
        self.chain = chain
        self.held = held

    def hold_landed(self, host_block: int) -> None:
        """A parent key it awaited landed: it holds that host block too."""
        self.held.append(host_block)

    def forsake(self) -> None:
        """Its request no longer waits for it (an offload cancelled the restore it was for)."""
        self.req = None


class CopyBook:
    def __init__(self, host: BlockPool | None = None) -> None:
        self.host = host  # keys a copy brings to it count as children there from the start
        self.records: dict[int, CopyRecord] = {}
        self.inflight: dict[bytes, int] = {}  # key -> plan id, for keys a SWAP_OUT brings to the host
        self.loading: dict[bytes, tuple[int, int]] = {}  # key -> (plan id, index), for keys a PREFIX_LOAD brings
        # in-flight key -> write-throughs (plan ids) and request chain holds (request, ChainHold.gen)
        # that hold its host block once it lands (a parent of theirs)
        self.awaited: dict[bytes, list[int | tuple[CacheRecord, int]]] = {}
        self.stores_in_flight = 0  # blocks of STOREs in flight (storage_writes.optional_store's backlog)
        self.swaps_in_flight = 0  # blocks of SWAP_INs in flight (the host link's queue, fastkv.sched.hits)
        self._next_id = 1

    def open(self, kind: CopyKind, purpose: Purpose, src: list[int] = (), dst: list[int] = (),
             keys: list[bytes] = (), req: CacheRecord | None = None, positions: list[int] | None = None,
             waiters: list[tuple[CacheRecord, dict[int, int]]] | None = None) -> CopyPlan:
        pid = self._next_id
        self._next_id += 1
        storage_keys = tuple(keys) if kind is CopyKind.STORE or kind is CopyKind.LOAD else ()
        plan = CopyPlan(pid, kind, src, dst, storage_keys)
        rec = self.records[pid] = CopyRecord(plan, purpose, list(src), list(dst), list(keys), req, positions, waiters)
        if self.host is not None and keys and kind in (CopyKind.SWAP_OUT, CopyKind.LOAD):
            rec.expected = self.host.expect(keys)
        if purpose is Purpose.WRITE_BACK or purpose is Purpose.WRITE_THROUGH:
            for k in keys:
                self.inflight[k] = pid
        elif purpose is Purpose.PREFIX_LOAD:
            for i, k in enumerate(keys):
                self.loading[k] = (pid, i)
        elif purpose is Purpose.STORE:
            self.stores_in_flight += len(src)
        if kind is CopyKind.SWAP_IN:
            self.swaps_in_flight += len(plan.dst)
        return plan

    def await_parent(self, key: bytes, holder: int | tuple[CacheRecord, int]) -> None:
        """``holder`` (a write-through's plan id, or a request's chain hold) holds ``key``'s host
        block once the copy bringing it lands."""
        self.awaited.setdefault(key, []).append(holder)

    def take_awaiting(self, key: bytes) -> list[int | tuple[CacheRecord, int]]:
        return self.awaited.pop(key, ())

    def join_load(self, plan_id: int, req: CacheRecord, slots: dict[int, int]) -> None:
        """``req`` waits for the PREFIX_LOAD ``plan_id`` too: plan index -> its load.swap_src slot."""
        self.records[plan_id].waiters.append((req, slots))

    def open_control(self, make: Callable[[int], ClearTask | RestoreTask]) -> ClearTask | RestoreTask:
        """A control task under the next plan id (``make(plan_id)``), completed like a copy."""
        pid = self._next_id
        self._next_id += 1
        task = make(pid)
        self.records[pid] = CopyRecord(task, Purpose.CONTROL, [], [], [], None, None)
        return task

    def close(self, plan: CopyPlan | ClearTask | RestoreTask) -> CopyRecord:
        if not isinstance(plan, CopyPlan | ClearTask | RestoreTask):
            raise TypeError(f"complete() takes a CopyPlan or a control task, got {type(plan).__name__}")
        rec = self.records.get(plan.plan_id)
        if rec is None or rec.plan is not plan:
            raise ValueError(f"plan {plan.plan_id} is not in flight (completed twice, or not from this manager)")
        del self.records[plan.plan_id]
        if rec.expected:
            self.host.unexpect(rec.expected)
        if rec.purpose is Purpose.WRITE_BACK or rec.purpose is Purpose.WRITE_THROUGH:
            inflight = self.inflight
            for k in rec.keys:
                if inflight.get(k) == plan.plan_id:
                    del inflight[k]
        elif rec.purpose is Purpose.PREFIX_LOAD:
            loading = self.loading
            for k in rec.keys:
                if loading.get(k, (0,))[0] == plan.plan_id:
                    del loading[k]
        elif rec.purpose is Purpose.STORE:
            self.stores_in_flight -= len(rec.src)
        if isinstance(plan, CopyPlan) and plan.kind is CopyKind.SWAP_IN:
            self.swaps_in_flight -= len(plan.dst)
        return rec


# ---- coalesced storage loads: one LOAD per key, however many admissions want it at once.
#
# After a restart every request of the first admission wave misses the device and host, and
# many share prefixes. Without this, each admission LOADs its own copy of a shared prefix into
# its own host staging blocks: the storage tier serves the same bytes many times, the loads
# queue behind each other in the transfer processes, and the copies never share a block.
#
# Instead, an admission whose storage hit starts with keys another request's PREFIX_LOAD is
# bringing (``CopyBook.loading``) joins that LOAD: it waits for it like for its own copies,
# and when it lands takes a reference on the staged host blocks and swaps them in from there.
# Only the keys nobody is loading are LOADed for it, up to the first one that is in flight
# (past that, the chain would interleave two loads; the rest is recomputed, as without room).
#
# Hit counting (CacheStats): a block is a storage hit only for the request whose LOAD brought
# it; a request that joined is served from the host, where that LOAD landed, and counts a host
# hit. So the storage hit ratio counts each stored block once per load, as the storage tier
# served it, and a failed shared LOAD is a miss for every request that waited for it.


def split(state: CacheState, keys: list[bytes]) -> tuple[list[tuple[int, int]], list[bytes]]:
    """``keys`` (a storage hit, in chain order) as the leading run other LOADs bring, as
    (plan id, index in it), and the keys after it up to the next one in flight."""
    loading = state.copies.loading
    joins: list[tuple[int, int]] = []
    for k in keys:
        at = loading.get(k)
        if at is None:
            break
        joins.append(at)
    own = keys[len(joins):]
    for i, k in enumerate(own):
        if k in loading:
            return joins, own[:i]
    return joins, own


def join(state: CacheState, req: CacheRecord, joins: list[tuple[int, int]], first_slot: int) -> int:
    """``req`` waits for the LOADs in ``joins``; their blocks fill its load.swap_src from
    ``first_slot``. Returns how many plans it now waits for."""
    slots: dict[int, dict[int, int]] = {}
    for s, (pid, i) in enumerate(joins, first_slot):
        slots.setdefault(pid, {})[i] = s
    for pid, mine in slots.items():
        state.copies.join_load(pid, req, mine)
    state.stats.joined_load_blocks += len(joins)
    return len(slots)

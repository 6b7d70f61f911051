"""CacheState: everything the cache knows, in pieces that each have an owner.

The pools, the prefix index, the copies in flight, the request records, the counters and the
small books below live here. Each piece changes only through its own class's methods: the
role modules (tiering.py, release.py, offload.py, completions.py, storage_writes.py,
handoff.py) take a ``CacheState`` and call them, and never rebind or mutate its attributes
themselves (tests/unit/test_architecture.py checks this on the source). ``CacheManager`` is
the facade the scheduler and the engine call. Imports run one way: state and plan -> role
modules -> manager.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

from fastkv.cache.copies import CopyBook
from fastkv.cache.eviction import POLICIES
from fastkv.cache.index import Cause, PrefixIndex
from fastkv.cache.keys import BlockKey, KeyNamespace, ResumeKey, root_key
from fastkv.cache.pool import BlockPool
from fastkv.cache.requests import CacheRecord, ReqState
from fastkv.cache.store_backlog import DeferredStores
from fastkv.cache.strands import note_lost
from fastkv.cache.write_policy import StorageWrites, Tier, WritePolicy
from fastkv.config import KVLayout

if TYPE_CHECKING:
    from fastkv.cache.residency import ResidencyLog


@dataclass(frozen=True, slots=True)
class CacheConfig:
    num_device_blocks: int
    num_host_blocks: int = 0
    block_size: int = 64
    policy: WritePolicy = WritePolicy.WRITE_BACK
    eviction: str = "lru"  # a fastkv.cache.eviction.POLICIES name: the order CACHED blocks leave each tier
    selective_hits: int = 2  # WRITE_THROUGH_SELECTIVE: copy to host on this many hits
    storage: bool = False  # a storage tier exists: host blocks are STOREd, prefixes LOADed
    storage_writes: StorageWrites = StorageWrites.THROUGH  # which host blocks are STOREd (storage_writes.py)
    flush_window: int = 32  # BACK: most blocks flushed ahead of the host's evictions at once
    # STORE blocks in flight beyond which the write policies' optional STOREs are skipped and
    # counted: storage slower than the engine makes blocks falls behind, never stalls a step
    storage_backlog_blocks: int = 256
    storage_keys: int = 1 << 22  # how many stored keys to remember
    history: int = 1 << 16  # departed keys remembered for explain_miss
    model_id: str = "model"
    weights_version: str = "0"
    layout: KVLayout | None = None  # its block_size must equal block_size

    def __post_init__(self) -> None:
        for name in ("num_device_blocks", "num_host_blocks", "block_size", "selective_hits", "storage_keys",
                     "history", "flush_window", "storage_backlog_blocks"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"CacheConfig.{name} must be an int >= 0, got {value!r}")
        if self.block_size <= 0 or self.num_device_blocks <= 0:
            raise ValueError("CacheConfig: block_size and num_device_blocks must be positive")
        object.__setattr__(self, "policy", WritePolicy(self.policy))
        object.__setattr__(self, "storage_writes", StorageWrites(self.storage_writes))
        if self.eviction not in POLICIES:
            raise ValueError(f"CacheConfig.eviction must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        if self.layout is not None and self.layout.block_size != self.block_size:
            raise ValueError(f"CacheConfig.block_size {self.block_size} != layout.block_size {self.layout.block_size}")

    def namespace(self, weights_version: str | None = None) -> KeyNamespace:
        version = self.weights_version if weights_version is None else str(weights_version)
        if self.layout is not None:
            return KeyNamespace.for_layout(self.model_id, version, self.layout)
        return KeyNamespace(self.model_id, version, f"block={self.block_size}", "unspecified", self.block_size, 1)


# Hit and copy counters of a cache manager. Plain integers bumped on the hot path.
@dataclass(slots=True)
class CacheStats:
    requests: int = 0  # allocations (prefix lookups that count toward hit ratios)
    prompt_tokens: int = 0
    prompt_blocks: int = 0  # full blocks looked up
    # Tokens served from each tier: device hits at lookup, host and storage hits once their
    # copies landed (a planned hit whose copy fails is recomputed, not served).
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    storage_lost_tokens: int = 0  # planned storage hits whose LOAD failed: recomputed because of storage
    device_evictions: int = 0  # device blocks evicted (moved to host or dropped)
    host_evictions: int = 0
    unstored_host_evictions: int = 0  # host evictions of blocks the storage tier does not hold
    dropped_keys: int = 0  # keys that left every tier
    inserted_blocks: int = 0
    duplicate_blocks: int = 0  # computed blocks whose key another block already held
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    store_blocks: int = 0
    load_blocks: int = 0
    joined_load_blocks: int = 0  # blocks an admission took from another's LOAD in flight (copies.join)
    failed_copies: int = 0  # plans completed with ok=False
    load_misses: int = 0  # blocks of failed LOADs
    skipped_copies: int = 0  # host copies not made when due: no host block free
    # blocks a write policy would store, lost to the pool: deferred while storage was behind and
    # evicted from the host before it caught up (store_backlog.py); and of those, by reason
    skipped_stores: int = 0
    skipped_tail_stores: int = 0  # blocks of unshared tails
    skipped_shared_stores: int = 0  # shared blocks (or near their chain's root)
    late_stores: int = 0  # deferred STOREs made once storage caught up
    already_stored_skips: int = 0  # blocks a write policy would store that the pool already held
    late_copies: int = 0  # skipped write-throughs made later, once host blocks were free
    chain_spills: int = 0  # running requests' chain holds let go of for want of host room (tiering.make_host_room)
    offloads: int = 0
    restores: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    def hit_ratio(self, tier: str | None = None) -> float:
        """Prompt-token hit ratio, overall or of one tier ("device", "host", "storage")."""
        hits = self.hit_tokens if tier is None else getattr(self, f"{tier}_hit_tokens")
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    def skipped_by(self) -> dict[str, int]:
        """Blocks a write policy wanted stored and did not, by reason (``store_backlog.REASONS``)."""
        return {"already_stored": self.already_stored_skips, "tail": self.skipped_tail_stores,
                "shared": self.skipped_shared_stores}

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out.update(hit_ratio=self.hit_ratio(), device_hit_ratio=self.hit_ratio("device"),
                   host_hit_ratio=self.hit_ratio("host"), storage_hit_ratio=self.hit_ratio("storage"))
        return out


class Reservations:
    """Device blocks promised to requests for decode growth: the total, and each record's share
    (``CacheRecord.reserved``), changed together."""

    __slots__ = ("total",)

    def __init__(self) -> None:
        self.total = 0

    def promise(self, req: CacheRecord, n: int) -> None:
        req.reserved += n
        self.total += n

    def take_back(self, req: CacheRecord, n: int | None = None) -> None:
        """``n`` of the request's reserved blocks (all of them by default) are no longer promised."""
        n = req.reserved if n is None else n
        req.reserved -= n
        self.total -= n


class Weights:
    """The weights the cache's keys are made under, and a weight update in progress."""

    __slots__ = ("namespace", "root", "retired", "paused")

    def __init__(self, namespace: KeyNamespace) -> None:
        self.namespace = namespace
        self.root = root_key(namespace)
        self.retired: list[KeyNamespace] = []  # namespaces of earlier weights, for explain_miss
        self.paused = False  # a weight update is in progress

    def begin_update(self) -> None:
        self.retired.append(self.namespace)
        del self.retired[:-4]
        self.paused = True

    def finish_update(self, version: str) -> None:
        self.namespace = self.namespace.with_weights(version)
        self.root = root_key(self.namespace)
        self.paused = False


class ThroughBook:
    """Write-through's bookkeeping beside the copies: selective hit counts, the copies skipped for
    want of a host block, and the running requests holding their chain's host copies."""

    __slots__ = ("hits", "skipped", "holders")

    def __init__(self) -> None:
        self.hits: dict[BlockKey, int] = {}  # WRITE_THROUGH_SELECTIVE hit counts of device keys
        # write-throughs skipped for want of a free host block (say, every one pinned by STOREs to a
        # slow storage tier): key -> the chain it was to be copied with; made once host blocks free
        # up, oldest (parents) first, if the key is then still on the device only (tiering.py)
        self.skipped: OrderedDict[BlockKey, list[BlockKey]] = OrderedDict()
        # running requests holding their chain's host copies, the least recently extended hold first
        self.holders: OrderedDict[object, CacheRecord] = OrderedDict()

    def count_hit(self, key: BlockKey) -> int:
        count = self.hits.get(key, 0) + 1
        self.hits[key] = count
        return count

    def forget_hits(self, keys) -> None:
        pop = self.hits.pop
        for k in keys:
            pop(k, None)

    def skip(self, keys, chain: list[BlockKey], limit: int) -> None:
        skipped = self.skipped
        for k in keys:
            skipped[k] = chain
            skipped.move_to_end(k)
        while len(skipped) > limit:  # the oldest are the likeliest gone from the device
            skipped.popitem(last=False)

    def oldest_skipped(self) -> tuple[BlockKey, list[BlockKey]]:
        return self.skipped.popitem(last=False)

    def holding(self, req: CacheRecord, new: bool) -> None:
        """``req`` holds its chain (``new``: from now on), the most recently extended hold."""
        if new:
            self.holders[req.rid] = req
        else:
            self.holders.move_to_end(req.rid)

    def let_go(self, req: CacheRecord) -> None:
        del self.holders[req.rid]

    def forget_all(self) -> None:
        """A weight update: every key it knows is gone."""
        self.hits.clear()
        self.skipped.clear()


class Preemptions:
    """Offloads so far (each partial block's private key is unique by its epoch), and the resume
    keys of requests preempted in storage mode: only their own re-admission looks one up, once."""

    __slots__ = ("epoch", "resumes", "limit")

    def __init__(self, limit: int) -> None:
        self.epoch = 0
        self.resumes: OrderedDict[object, ResumeKey] = OrderedDict()
        self.limit = limit

    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def remember_resume(self, rid: object, key: ResumeKey) -> None:
        """Bounded: a request aborted before it resumed leaves its entry, which ages out."""
        resumes = self.resumes
        resumes[rid] = key
        if len(resumes) > self.limit:
            resumes.popitem(last=False)

    def resume_key(self, rid: object) -> ResumeKey | None:
        return self.resumes.get(rid)

    def forget_resume(self, rid: object) -> None:
        del self.resumes[rid]


class BackFlush:
    """Host evictions the BACK storage flush has not answered yet (storage_writes.py)."""

    __slots__ = ("evicted",)

    def __init__(self) -> None:
        self.evicted = 0

    def count(self, n: int) -> None:
        self.evicted += n

    def take(self) -> int:
        n, self.evicted = self.evicted, 0
        return n


class ExportHolds:
    """A prefill handoff's device blocks, kept (one reference each) until its export is stored:
    once its request is freed, eviction could take them before a retry (fastkv.cache.handoff).
    Exports that share a key share its hold, counted."""

    __slots__ = ("device", "holds")

    def __init__(self, device: BlockPool) -> None:
        self.device = device
        self.holds: dict[bytes, list[int]] = {}  # key -> [device block, exports holding it]

    def hold(self, block: int, key: bytes) -> None:
        held = self.holds.get(key)
        if held is None:
            self.device.incref(block)
            self.holds[key] = [block, 1]
        else:
            held[1] += 1

    def release(self, key: bytes) -> None:
        held = self.holds[key]
        held[1] -= 1
        if not held[1]:
            del self.holds[key]
            self.device.release(held[0])

    def __getitem__(self, key: bytes) -> tuple[int, int]:
        """(device block, exports holding it)."""
        block, count = self.holds[key]
        return block, count

    def __contains__(self, key: object) -> bool:
        return key in self.holds

    def __iter__(self):
        return iter(self.holds)

    def __len__(self) -> int:
        return len(self.holds)

    def values(self) -> list[tuple[int, int]]:
        return [(b, c) for b, c in self.holds.values()]


class CacheState:
    """The pieces of the cache, each changed through its own methods; this class assigns its
    attributes once, here (tests/unit/test_architecture.py checks it)."""

    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.policy = config.policy
        self.device = BlockPool("device", config.num_device_blocks, config.eviction)
        self.host = BlockPool("host", config.num_host_blocks, config.eviction)
        self.index = PrefixIndex(self.device, self.host, config.storage, config.storage_keys, config.history)
        self.copies = CopyBook(self.host)
        self.stats = CacheStats()  # counters: every role module adds to them
        self.weights = Weights(config.namespace())
        self.reqs: dict[object, CacheRecord] = {}  # admit / let_go change it
        self.reservations = Reservations()
        self.handoff_holds = ExportHolds(self.device)
        self.through = ThroughBook()
        self.preemptions = Preemptions(config.history)
        self.flush = BackFlush()
        self.deferred_stores = DeferredStores()  # optional STOREs waiting for the backlog to drain
        self.run = os.urandom(16)  # scopes resume keys to this cache (keys.resume_key)
        # a device victim without a host copy is written back to the host: always under WRITE_BACK;
        # under WRITE_THROUGH, when the host evicted its copy first (a child's copy was still
        # flying then), so that a parent still leaves the device only for the host
        self.write_back = ((config.policy.copies_on_evict or config.policy.copies_on_insert)
                           and config.num_host_blocks > 0)
        self.touch_host = config.policy.host_inclusive and config.num_host_blocks > 0
        self.lost: list[bytes] = []  # keys gone from every tier with children left (strands.py)
        self.residency: ResidencyLog | None = None  # set by watch() while KV events are on

    @property
    def namespace(self) -> KeyNamespace:
        return self.weights.namespace

    @property
    def root(self) -> bytes:
        return self.weights.root

    @property
    def retired(self) -> list[KeyNamespace]:
        return self.weights.retired

    @property
    def paused(self) -> bool:
        return self.weights.paused

    @property
    def reserved(self) -> int:
        """Device blocks promised to requests for decode growth."""
        return self.reservations.total

    def watch(self, log: ResidencyLog) -> None:
        """Report residency changes to ``log`` from now on (fastkv.cache.residency.watch)."""
        self.residency = log

    def lose(self, key: bytes) -> None:
        """``key`` left its last tier with children left (strands.note_lost)."""
        self.lost.append(key)

    def take_lost(self) -> list[bytes]:
        lost, self.lost = self.lost, []
        return lost

    def admit(self, req: CacheRecord) -> None:
        self.reqs[req.rid] = req

    def let_go(self, request_id: object) -> CacheRecord | None:
        return self.reqs.pop(request_id, None)

    def get(self, request_id: object, *states: ReqState) -> CacheRecord:
        req = self.reqs.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        if states and req.state not in states:
            raise ValueError(f"request {request_id!r} is {req.state.name}, expected one of "
                             f"{[s.name for s in states]}")
        return req

    def forget_stored(self, cause: Cause) -> list[bytes]:
        """Every key storage holds leaves it (reset_prefix_cache); one a copy is bringing keeps
        its parent link, as in ``gone``: it lands only under its parent. Returns the keys."""
        stored = list(self.index.stored)
        copies, parents = self.copies, self.index.parents
        flying = {k: parents[k] for k in stored if k in parents and (k in copies.inflight or k in copies.loading)}
        self.index.gone_many(stored, Tier.STORAGE, cause)
        self.index.forget_all_stored()
        parents.update(flying)
        return stored

    def gone(self, key: bytes, tier: Tier, cause: Cause) -> None:
        self.stats.dropped_keys += 1
        copies = self.copies
        flying = key in copies.inflight or key in copies.loading
        pk = self.index.parents.get(key) if flying else None
        self.index.gone(key, tier, cause)
        if pk is not None:  # a copy lands it yet: only under its parent (strands.parent_present)
            self.index.parents[key] = pk
        note_lost(self, key)  # its children could never be matched again: dropped (strands.py)

    def gone_if_last(self, key: bytes, tier: Tier, cause: Cause, skip: Tier) -> None:
        if skip is not Tier.HOST and key in self.host.lookup:
            return
        if skip is not Tier.DEVICE and key in self.device.lookup:
            return
        if key not in self.index.stored:
            self.gone(key, tier, cause)

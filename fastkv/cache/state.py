"""CacheState: everything the cache knows, with one owner.

The pools, the prefix index, the copies in flight, the request records and the counters
live here. The role modules (tiering.py, release.py, offload.py, completions.py,
integrity.py) take a ``CacheState`` and change it; ``CacheManager`` is the facade the
scheduler calls. Imports run one way: state and results -> role modules -> manager.
"""
from __future__ import annotations

import os
from collections import OrderedDict
from dataclasses import dataclass

from fastkv.cache.copies import CopyBook
from fastkv.cache.eviction import POLICIES
from fastkv.cache.index import Cause, PrefixIndex
from fastkv.cache.keys import KeyNamespace, root_key
from fastkv.cache.pool import BlockPool
from fastkv.cache.requests import CacheRecord, ReqState
from fastkv.cache.stats import CacheStats
from fastkv.cache.strands import note_lost
from fastkv.cache.write_policy import StorageWrites, Tier, WritePolicy
from fastkv.config import KVLayout


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
    storage_keys: int = 1 << 22  # how many stored keys to remember
    history: int = 1 << 16  # departed keys remembered for explain_miss
    model_id: str = "model"
    weights_version: str = "0"
    layout: KVLayout | None = None  # its block_size must equal block_size

    def __post_init__(self) -> None:
        for name in ("num_device_blocks", "num_host_blocks", "block_size", "selective_hits", "storage_keys",
                     "history", "flush_window"):
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


class CacheState:
    def __init__(self, config: CacheConfig) -> None:
        self.config = config
        self.block_size = config.block_size
        self.policy = config.policy
        self.device = BlockPool("device", config.num_device_blocks, config.eviction)
        self.host = BlockPool("host", config.num_host_blocks, config.eviction)
        self.index = PrefixIndex(self.device, self.host, config.storage, config.storage_keys, config.history)
        self.copies = CopyBook(self.host)
        self.stats = CacheStats()
        self.namespace = config.namespace()
        self.root = root_key(self.namespace)
        self.retired: list[KeyNamespace] = []  # namespaces of earlier weights, for explain_miss
        self.reqs: dict[object, CacheRecord] = {}
        self.reserved = 0  # device blocks promised to requests for decode growth
        # a prefill handoff's blocks, kept (one reference each) until its export is stored: once
        # its request is freed, eviction could take them before a retry (fastkv.cache.handoff)
        self.handoff_holds: dict[bytes, list[int]] = {}  # key -> [device block, exports holding it]
        self.hits: dict[bytes, int] = {}  # WRITE_THROUGH_SELECTIVE hit counts of device keys
        # write-throughs skipped for want of a free host block (say, every one pinned by STOREs to a
        # slow storage tier): key -> the chain it was to be copied with; made once host blocks free
        # up, oldest (parents) first, if the key is then still on the device only (tiering.py)
        self.skipped_through: OrderedDict[bytes, list[bytes]] = OrderedDict()
        self.epoch = 0  # offloads so far: makes each partial block's private key unique
        self.run = os.urandom(16)  # scopes resume keys to this cache (keys.resume_key)
        # storage-mode preempted requests -> their resume key: only their own re-admission looks it up, once
        self.resumes: OrderedDict[object, bytes] = OrderedDict()
        self.evicted_since_flush = 0  # host evictions the BACK storage flush has not answered yet
        self.paused = False  # a weight update is in progress
        # running requests holding their chain's host copies, the least recently extended hold first
        self.chain_holders: OrderedDict[object, CacheRecord] = OrderedDict()
        # a device victim without a host copy is written back to the host: always under WRITE_BACK;
        # under WRITE_THROUGH, when the host evicted its copy first (a child's copy was still
        # flying then), so that a parent still leaves the device only for the host
        self.write_back = ((config.policy.copies_on_evict or config.policy.copies_on_insert)
                           and config.num_host_blocks > 0)
        self.touch_host = config.policy.host_inclusive and config.num_host_blocks > 0
        self.lost: list[bytes] = []  # keys gone from every tier with children left (strands.py)
        self.residency = None  # a fastkv.cache.residency.ResidencyLog while KV events are on

    def get(self, request_id: object, *states: ReqState) -> CacheRecord:
        req = self.reqs.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        if states and req.state not in states:
            raise ValueError(f"request {request_id!r} is {req.state.name}, expected one of "
                             f"{[s.name for s in states]}")
        return req

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

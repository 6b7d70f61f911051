"""The prefix index across tiers, and the memory of why keys left it.

One flat map per tier (the pools' ``lookup``: key -> block id), plus the keys this engine has
stored to the storage tier (an insertion-ordered dict, bounded: the storage tier evicts on its
own, so a remembered key can still miss on LOAD, and the request then recomputes).

``match(keys)`` walks a request's chain of full-block keys from the root and returns the
longest hit as three consecutive runs: blocks on the device, then on the host, then keys the
storage tier may hold. A block is looked for in the fastest tier first; the run stops at the
first block no tier has.

Strands. With chained keys and a flat map, a key whose parent is in no tier can never be
matched: match walks from the root. fastkv keeps every tier's LRU queue "parents no older
than their children", so that LRU eviction takes leaves first:

* a request releases its blocks last to first (children enter the LRU queue before parents);
* releasing a block whose key another block holds (a duplicate computed concurrently)
  refreshes that other block too;
* a prefix hit takes the whole matched run, parents included, out of the LRU queue;
* under write-back, device victims (LRU, hence children first) go to the host in that order,
  and a parent leaves the device only by moving to the host;
* under write-through, host copies land parent first, so a request's release refreshes its
  host copies last to first as well, and so does each landing copy whose request let go of
  its chain for its chain's copies in both tiers (its device sources re-entered the queue
  young when it unpinned them); a device
  victim whose host copy the host evicted first is written back, as under write-back;
* a running request holds the host copies of its chain while it holds its device blocks
  (the host's queue cannot order children that are not in it yet), and lets them go leaves
  first with its table; a write-through still in flight then holds its chain's other keys
  until it lands, and releasing them leaves first orders the host half of its chain, which its
  refresh then skips.

The pools also keep leaves first by construction (``fastkv.cache.pool``): from ``parents``,
each names the keyed children of every key in its tier (and those a copy brings there), and
passes over a parent that has any; a device parent of host blocks leaves the device for the host
(``tiering.take_device``). So the order above is a matter of LRU accuracy, not of strands.

A loss can still take a parent from every tier: a copy that fails or finds no free host
block, a request freed without caching, a key storage lost, a parent a tier had to evict with
children held or in flight (nothing else was cached: ``forced_evictions``). Its cached children
are then dropped with it (``fastkv.cache.strands``, Cause.STRANDED), so no cached key is ever
stranded; ``check_integrity`` asserts it.
"""
from __future__ import annotations

from collections import OrderedDict
from enum import IntEnum
from itertools import islice
from typing import NamedTuple

from fastkv.cache.pool import BlockPool
from fastkv.cache.write_policy import Tier, WritePolicy


class Cause(IntEnum):
    """Why a key left its last tier."""

    EVICTED = 1  # LRU eviction (under the tier policy)
    COPY_FAILED = 2  # its write-back failed
    NO_HOST_ROOM = 3  # write-back found no free host block
    DROPPED = 4  # its request was freed with cache=False
    STORAGE_MISS = 5  # a LOAD found it gone from storage
    WEIGHT_UPDATE = 6  # cleared by a weight update (the namespace changed)
    RESET = 7  # dropped by reset_prefix_cache
    STRANDED = 8  # its parent left every tier (a loss upstream): it could never be matched


class MissReason(IntEnum):
    HIT = 0  # every full block was found
    NEVER_STORED = 1
    EVICTED = 2  # see tier, cause, policy
    OTHER_NAMESPACE = 3  # known under another namespace (older weights)
    IN_FLIGHT = 4  # a copy is bringing it into a tier


class MissExplanation(NamedTuple):
    reason: MissReason
    block_index: int  # first block not found (== number of leading blocks found)
    num_blocks: int  # full blocks of the queried tokens
    tier: Tier | None = None  # tier it was evicted from
    cause: Cause | None = None
    policy: WritePolicy | None = None
    detail: str = ""


class MatchResult(NamedTuple):
    """The longest cached prefix: device run, then host run, then storage run."""

    device_blocks: tuple[int, ...]
    host_blocks: tuple[int, ...]
    storage_keys: tuple[bytes, ...]
    block_size: int
    num_tokens: int  # tokens queried

    @property
    def num_blocks(self) -> int:
        return len(self.device_blocks) + len(self.host_blocks) + len(self.storage_keys)

    @property
    def num_device_tokens(self) -> int:
        return len(self.device_blocks) * self.block_size

    @property
    def num_hit_tokens(self) -> int:
        return self.num_blocks * self.block_size


class PrefixIndex:
    def __init__(self, device: BlockPool, host: BlockPool, storage: bool, storage_keys: int, history: int) -> None:
        self.device = device
        self.host = host
        self.storage = storage
        self.stored: OrderedDict[bytes, None] = OrderedDict()  # popitem(last=False) is O(1)
        self.storage_keys = storage_keys
        self.history: dict[bytes, tuple[Tier, Cause]] = {}  # insertion ordered, trimmed by gone_many
        self.history_size = history
        # key -> its parent key, for every chained key a request computed that some tier may still
        # get or has: the pools count each key's keyed children per tier from it (leaves first).
        # The device takes a computed key's parent from its request's chain, so without a host tier
        # computed keys are not entered here.
        self.parents: dict[bytes, bytes] = {}
        device.parents = host.parents = self.parents
        # one shared tuple per (tier, cause): recording a departure allocates nothing
        self._records = {(t, c): (t, c) for t in Tier for c in Cause}

    def match(self, keys: list[bytes], limit: int) -> tuple[list[int], list[int], list[bytes]]:
        """Longest run of ``keys[:limit]`` found: (device blocks, host blocks, storage keys)."""
        dget = self.device.lookup.get
        dev: list[int] = []
        i = 0
        n = min(limit, len(keys))
        while i < n:
            b = dget(keys[i])
            if b is None:
                break
            dev.append(b)
            i += 1
        host: list[int] = []
        if i < n and self.host.capacity:
            hget = self.host.lookup.get
            while i < n:
                b = hget(keys[i])
                if b is None:
                    break
                host.append(b)
                i += 1
        stored: list[bytes] = []
        if i < n and self.stored:
            s = self.stored
            while i < n and keys[i] in s:
                stored.append(keys[i])
                i += 1
        return dev, host, stored

    def present(self, key: bytes) -> bool:
        return key in self.device.lookup or key in self.host.lookup or key in self.stored

    def learn(self, keys: list[bytes], parent: bytes | None) -> None:
        """``keys`` is a chain hanging under ``parent`` (None: under the root)."""
        parents = self.parents
        for k in keys:
            if parent is not None:
                parents[k] = parent
            parent = k

    def learn_span(self, keys: list[bytes], first: int, stop: int) -> None:
        """``learn_at(keys, range(first, stop))`` in one dict update (the path of every compute)."""
        first = max(first, 1)
        if first < stop:
            self.parents.update(zip(keys[first:stop], keys[first - 1:stop - 1], strict=True))

    def learn_at(self, keys: list[bytes], positions: list[int]) -> None:
        """The parents of ``keys[i]`` for each ``i`` in ``positions`` (a request's chain, about to
        be keyed in a tier: the entry may have gone with an earlier copy of the key)."""
        parents = self.parents
        for i in positions:
            if i:
                parents[keys[i]] = keys[i - 1]

    def remember_stored(self, key: bytes) -> None:
        self.stored[key] = None
        if len(self.stored) > self.storage_keys:
            old, _ = self.stored.popitem(last=False)
            if old not in self.device.lookup and old not in self.host.lookup:
                self.parents.pop(old, None)

    def forget_stored(self, key: bytes) -> None:
        """Storage no longer holds ``key`` (a LOAD missed), or nothing may load it again."""
        self.stored.pop(key, None)

    def forget_all_stored(self) -> None:
        self.stored.clear()

    def gone(self, key: bytes, tier: Tier, cause: Cause) -> None:
        """``key`` left its last tier: remember why, for ``explain_miss`` (bounded history)."""
        if self.history_size:
            self.gone_many((key,), tier, cause)
        else:
            self.parents.pop(key, None)

    def gone_many(self, keys, tier: Tier, cause: Cause) -> None:
        """One plain dict store per key; the oldest half is cut in one pass once the history
        doubles its size (amortized O(1), and much cheaper than an LRU dict per eviction)."""
        if self.parents:  # empty without a host tier (learn_span)
            pop = self.parents.pop
            for k in keys:
                pop(k, None)
        if not self.history_size:
            return
        h = self.history
        h.update(dict.fromkeys(keys, self._records[tier, cause]))  # one shared tuple: nothing per key
        if len(h) > 2 * self.history_size:
            self.history = dict(islice(h.items(), len(h) - self.history_size, None))

    def clear(self) -> list[bytes]:
        """Forget every key (weight update); returns them."""
        dropped = self.device.clear() + self.host.clear() + list(self.stored)
        self.stored.clear()
        self.parents.clear()
        return dropped

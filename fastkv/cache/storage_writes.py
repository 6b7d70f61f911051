"""Storage write policies: which host blocks the cache STOREs to the storage tier.

The storage tier is a pool other engines and later runs read (fastkv.engine.lookup), so what
reaches it decides what they can hit. Every STORE reads a host block (it stays pinned until
the write lands), so each policy trades storage bandwidth and pinned host blocks for hits:

===========  ========================================  =========================================
policy       stored                                    costs
===========  ========================================  =========================================
PREEMPTED    the full blocks of a request preempted     the fewest writes; another engine or a
             by copy (offload or storage mode)          restart hits only what was preempted
THROUGH      every block once it lands in the host      one write per distinct block computed
             tier (under host write-through: every      (the most bandwidth); every block is in
             full block once computed)                  the pool while its host copy lives
BACK         host blocks about to be evicted: under     one write per host eviction, so hot
             eviction pressure the blocks nearest the   prefixes the host keeps are never
             host's eviction end are flushed ahead      written; a block a burst of evictions
             (up to ``flush_window`` blocks)            outruns is lost to storage (counted)
===========  ========================================  =========================================

Under every policy a request preempted in storage mode stores its full blocks and its partial
last block (under a request-scoped key, ``keys.resume_key``): that is what the mode is for.

BACK cannot write a block out at the moment the host evicts it: the evicting copy
overwrites it on another lane, with no order between the two. So it flushes ahead, like a
page cache's writeback: each time the host evicts ``n`` blocks, the next ``n`` (at most
``flush_window``) unstored blocks at its eviction end are STOREd. A flushed block is pinned
while it is written and re-enters the host queue as recently used (a second chance, as in
CLOCK), so flushing keeps pace with evictions instead of writing the whole host tier.

What THROUGH and BACK store is optional: the host holds the bytes either way. When the storage
tier is slower than the engine makes blocks, STOREs pile up; past ``storage_backlog_blocks`` in
flight, those optional STOREs are deferred (made once the backlog drains, if the host still holds
the block) or, failing that, skipped and counted (``skipped_stores``, by reason), so storage falls
behind instead of pinning host blocks without bound or stalling a step. Unshared tails are
deferred before shared prefixes (``fastkv.cache.store_backlog``). A request preempted
to storage (or under PREEMPTED) is always stored: it resumes from what was written.
"""
from __future__ import annotations

import math
from itertools import islice

from fastkv.cache.plan import CopyPlan
from fastkv.cache.requests import CacheRecord
from fastkv.cache.state import CacheState
from fastkv.cache.store_backlog import SHARED, TAIL_SHARE, admit, rank
from fastkv.cache.tiering import store
from fastkv.cache.write_policy import StorageWrites


def deferred(state: CacheState) -> list[CopyPlan]:
    """The BACK flush's STOREs, handed out with the next plans the manager returns (host
    evictions happen deep inside calls that return other plans)."""
    return _flush_back(state) if state.flush.evicted else []


def _flush_back(state: CacheState) -> list[CopyPlan]:
    """BACK: STORE as many unstored blocks at the host's eviction end as it evicted since the
    last flush (at most ``flush_window``)."""
    n = min(state.flush.take(), state.config.flush_window)
    if state.config.storage_writes is not StorageWrites.BACK or not state.index.storage:
        return []
    host, stored, inflight = state.host, state.index.stored, state.copies.inflight
    key = host.key
    blocks: list[int] = []
    keys: list[bytes] = []
    # the scan is bounded: blocks already stored at the end are passed over, up to the window
    for b in islice(host.evictable, state.config.flush_window + n):
        k = key[b]
        if k not in stored and k not in inflight:
            blocks.append(b)
            keys.append(k)
            if len(blocks) == n:
                break
    return optional_store(state, blocks, keys)


def optional_store(state: CacheState, blocks: list[int], keys: list[bytes]) -> list[CopyPlan]:
    """STOREs a write policy wants but nobody needs: those the backlog has room for; the least
    valuable deferred first (``fastkv.cache.store_backlog``)."""
    stored, stats = state.index.stored, state.stats
    if any(k in stored for k in keys):  # those need no STORE
        pairs = [(b, k) for b, k in zip(blocks, keys, strict=True) if k not in stored]
        stats.already_stored_skips += len(blocks) - len(pairs)
        blocks, keys = [b for b, _ in pairs], [k for _, k in pairs]
    backlog, in_flight = state.config.storage_backlog_blocks, state.copies.stores_in_flight
    if in_flight + len(blocks) > math.ceil(backlog * TAIL_SHARE):  # under pressure: rank them
        host, dev, parents = state.host, state.device, state.index.parents
        ranks = [rank(host, dev, parents, b, k) for b, k in zip(blocks, keys, strict=True)]
        keep = admit(ranks, in_flight, backlog)
        # deferred while a STORE is in flight: its completion catches up; else nothing would
        later = in_flight > 0 or any(keep)
        for k, r, kept in zip(keys, ranks, keep, strict=True):
            if kept:
                continue
            if later:
                state.deferred_stores.defer(k, r)
            else:
                _lost(state, r)
        blocks = [b for b, kept in zip(blocks, keep, strict=True) if kept]
        keys = [k for k, kept in zip(keys, keep, strict=True) if kept]
    return store(state, blocks, keys) if blocks else []


def catch_up(state: CacheState) -> list[CopyPlan]:
    """A STORE landed or failed: once those in flight have drained to half of what tails may fill,
    the deferred STOREs whose blocks the host still holds, best first, as far as the backlog has
    room (the rest wait for the next); one whose host copy is gone is lost to the pool."""
    deferred = state.deferred_stores
    backlog, in_flight = state.config.storage_backlog_blocks, state.copies.stores_in_flight
    if not deferred or in_flight > math.ceil(backlog * TAIL_SHARE) // 2:
        return []
    lookup, stored = state.host.lookup, state.index.stored
    blocks, keys, ranks = [], [], []
    for k, r in deferred.take_all():
        b = lookup.get(k)
        if k in stored:  # another STORE or a lookup put it there meanwhile
            continue
        if b is None:
            _lost(state, r)
            continue
        blocks.append(b)
        keys.append(k)
        ranks.append(r)
    keep = admit(ranks, in_flight, backlog)
    for k, r, kept in zip(keys, ranks, keep, strict=True):
        if not kept:
            deferred.defer(k, r)
    blocks = [b for b, kept in zip(blocks, keep, strict=True) if kept]
    keys = [k for k, kept in zip(keys, keep, strict=True) if kept]
    state.stats.late_stores += len(keys)
    return store(state, blocks, keys) if blocks else []


def _lost(state: CacheState, r: tuple[int, int]) -> None:
    stats = state.stats
    stats.skipped_stores += 1
    if r[0] == SHARED:
        stats.skipped_shared_stores += 1
    else:
        stats.skipped_tail_stores += 1


def landed_stores(state: CacheState, blocks: list[int], keys: list[bytes]) -> list[CopyPlan]:
    """A write-back or write-through copy landed these keyed host blocks: THROUGH stores them."""
    if state.index.storage and state.config.storage_writes is StorageWrites.THROUGH:
        return optional_store(state, blocks, keys)
    return []


def offload_stores(state: CacheState, req: CacheRecord, copied: list[tuple[int, bytes]]) -> list[CopyPlan]:
    """An offload landed (``copied``: the keyed blocks it copied). THROUGH stores those; a request
    preempted in storage mode, or any under PREEMPTED, stores all its full blocks, and in
    storage mode its partial last block under its resume key (on the host under that key too)."""
    if not state.index.storage:
        return []
    sw = state.config.storage_writes
    resume = req.resume
    if req.alive and (resume.to_storage or sw is StorageWrites.PREEMPTED):
        n_full = min(req.num_computed // state.block_size, len(req.keys))
        pairs = [(req.host_refs[i], req.keys[i]) for i in range(n_full)]
        if resume.to_storage and resume.private_key is not None and resume.private_block is None:
            pairs.append((req.host_refs[n_full], resume.private_key))
        return store(state, [b for b, _ in pairs], [k for _, k in pairs])
    if sw is StorageWrites.THROUGH:
        return optional_store(state, [b for b, _ in copied], [k for _, k in copied])
    return []

"""Blocks between tiers: where fresh blocks come from and the copies that move keyed bytes.

Taking fresh blocks evicts LRU ones; a device victim whose key has no other copy is written
back to the host (WRITE_BACK) in a plan its new owner waits for, or its key is gone. The other
helpers open the write-through, swap-in and store plans. Every function takes the manager and
only opens plans (pinning their blocks); completions.py settles them.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastkv.cache.copies import Purpose
from fastkv.cache.index import Cause
from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.cache.requests import CacheRecord
from fastkv.cache.write_policy import Tier

if TYPE_CHECKING:
    from fastkv.cache.manager import CacheManager


def take_device(mgr: CacheManager, n: int, owner: CacheRecord) -> tuple[list[int], CopyPlan | None]:
    """Fresh device blocks for ``owner``; evicted blocks without another copy are written back
    (WRITE_BACK) in a plan ``owner`` waits for, since it will overwrite them."""
    victims: list[tuple[int, bytes]] = []
    blocks = mgr.device.take_many(n, victims)
    if not victims:
        return blocks, None
    mgr.stats.device_evictions += len(victims)
    hlookup, stored = mgr.host.lookup, mgr.index.stored
    if not hlookup and not stored and not mgr._wb:  # device-only: every victim's key is gone
        mgr.stats.dropped_keys += len(victims)
        mgr.index.gone_many([k for _, k in victims], Tier.DEVICE, Cause.EVICTED)
        if mgr.policy.copies_on_hit:
            for _, k in victims:
                mgr._hits.pop(k, None)
        return blocks, None
    src: list[int] = []
    keys: list[bytes] = []
    selective = mgr._hits if mgr.policy.copies_on_hit else None
    for b, k in victims:
        if selective is not None:
            selective.pop(k, None)
        if k in hlookup:
            continue
        if mgr._wb:
            src.append(b)
            keys.append(k)
        elif k not in stored:
            mgr._gone(k, Tier.DEVICE, Cause.EVICTED)
    if not src:
        return blocks, None
    dst = take_host(mgr, len(src), pinned=True, partial=True)
    for k in keys[len(dst):]:
        mgr.stats.skipped_copies += 1
        if k not in stored:
            mgr._gone(k, Tier.DEVICE, Cause.NO_HOST_ROOM)
    if not dst:
        return blocks, None
    src, keys = src[:len(dst)], keys[:len(dst)]
    for b in src:
        mgr.device.pin(b)
    return blocks, mgr.copies.open(CopyKind.SWAP_OUT, Purpose.WRITE_BACK, src=src, dst=dst, keys=keys, req=owner)


def take_host(mgr: CacheManager, n: int, pinned: bool, partial: bool = False) -> list[int]:
    """``n`` host blocks (fewer if ``partial`` and the host is short), evicting LRU ones."""
    host = mgr.host
    if partial:
        n = min(n, host.num_available)
    victims: list[tuple[int, bytes]] = []
    take = host.take_pinned if pinned else host.take
    blocks = [take(victims) for _ in range(n)]
    assert all(b >= 0 for b in blocks), "host take ran out after the availability check"
    if victims:
        mgr.stats.host_evictions += len(victims)
        dlookup, stored = mgr.device.lookup, mgr.index.stored
        for _, k in victims:
            if k not in dlookup and k not in stored:
                mgr._gone(k, Tier.HOST, Cause.EVICTED)
    return blocks


def host_copies(mgr: CacheManager, pairs: list[tuple[int, bytes]]) -> list[CopyPlan]:
    """Write-through: copy keyed device blocks to the host (skipping keys it has or gets)."""
    hlookup, inflight = mgr.host.lookup, mgr.copies.inflight
    pairs = [(b, k) for b, k in pairs if k not in hlookup and k not in inflight]
    if not pairs:
        return []
    dst = take_host(mgr, len(pairs), pinned=True, partial=True)
    mgr.stats.skipped_copies += len(pairs) - len(dst)
    if not dst:
        return []
    src = [b for b, _ in pairs[:len(dst)]]
    for b in src:
        mgr.device.pin(b)
    keys = [k for _, k in pairs[:len(dst)]]
    return [mgr.copies.open(CopyKind.SWAP_OUT, Purpose.WRITE_THROUGH, src=src, dst=dst, keys=keys)]


def count_hits(mgr: CacheManager, req: CacheRecord, nd: int) -> list[CopyPlan]:
    hits, threshold, hot = mgr._hits, mgr.config.selective_hits, []
    for i in range(nd):
        k = req.keys[i]
        c = hits.get(k, 0) + 1
        hits[k] = c
        if c == threshold:
            hot.append((req.table[i], k))
    return host_copies(mgr, hot) if hot else []


def swap_in(mgr: CacheManager, req: CacheRecord) -> CopyPlan:
    """Phase two of a prefix hit or a restore: host -> device, once loads and write-backs
    of this request are done (its SWAP_IN may overwrite a block a write-back was reading)."""
    dst = [req.table[i] for i in req.swap_pos[:len(req.swap_src)]]
    for b in req.swap_src:
        mgr.host.pin(b)
    for b in dst:
        mgr.device.pin(b)
    req.pending += 1
    plan = mgr.copies.open(CopyKind.SWAP_IN, Purpose.SWAP_IN, src=req.swap_src, dst=dst, req=req,
                            positions=req.swap_pos[:len(dst)])
    req.swap_src = []
    req.swap_pos = []
    return plan


def store(mgr: CacheManager, blocks: list[int], keys: list[bytes]) -> list[CopyPlan]:
    stored = mgr.index.stored
    pairs = [(b, k) for b, k in zip(blocks, keys, strict=True) if k not in stored]
    if not pairs:
        return []
    for b, _ in pairs:
        mgr.host.pin(b)
    return [mgr.copies.open(CopyKind.STORE, Purpose.STORE, src=[b for b, _ in pairs],
                             keys=[k for _, k in pairs])]

"""Blocks between tiers: where fresh blocks come from and the copies that move keyed bytes.

Taking fresh blocks evicts LRU ones; a device victim whose key has no other copy is written
back to the host (WRITE_BACK) in a plan its new owner waits for, or its key is gone. The other
helpers open the write-through, swap-in and store plans. Every function takes the cache state and
only opens plans (pinning their blocks); completions.py settles them.
"""
from __future__ import annotations

from fastkv.cache.copies import Purpose
from fastkv.cache.index import Cause
from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.cache.requests import CacheRecord
from fastkv.cache.state import CacheState
from fastkv.cache.write_policy import Tier


def take_device(state: CacheState, n: int, owner: CacheRecord) -> tuple[list[int], CopyPlan | None]:
    """Fresh device blocks for ``owner``; evicted blocks without another copy are written back
    (WRITE_BACK) in a plan ``owner`` waits for, since it will overwrite them."""
    victims: list[tuple[int, bytes]] = []
    blocks = state.device.take_many(n, victims)
    if not victims:
        return blocks, None
    state.stats.device_evictions += len(victims)
    hlookup, stored, inflight = state.host.lookup, state.index.stored, state.copies.inflight
    if not hlookup and not stored and not state.write_back:  # device-only: every victim's key is gone
        state.stats.dropped_keys += len(victims)
        state.index.gone_many([k for _, k in victims], Tier.DEVICE, Cause.EVICTED)
        if state.policy.copies_on_hit:
            for _, k in victims:
                state.hits.pop(k, None)
        return blocks, None
    src: list[int] = []
    keys: list[bytes] = []
    selective = state.hits if state.policy.copies_on_hit else None
    for b, k in victims:
        if selective is not None:
            selective.pop(k, None)
        if k in hlookup or k in inflight:  # on the host, or on its way there (a second copy would race it)
            continue
        if state.write_back:
            src.append(b)
            keys.append(k)
        elif k not in stored:
            state.gone(k, Tier.DEVICE, Cause.EVICTED)
    if not src:
        return blocks, None
    dst = take_host(state, len(src), pinned=True, partial=True)
    for k in keys[len(dst):]:
        state.stats.skipped_copies += 1
        if k not in stored:
            state.gone(k, Tier.DEVICE, Cause.NO_HOST_ROOM)
    if not dst:
        return blocks, None
    src, keys = src[:len(dst)], keys[:len(dst)]
    for b in src:
        state.device.pin(b)
    return blocks, state.copies.open(CopyKind.SWAP_OUT, Purpose.WRITE_BACK, src=src, dst=dst, keys=keys, req=owner)


def take_host(state: CacheState, n: int, pinned: bool, partial: bool = False) -> list[int]:
    """``n`` host blocks (fewer if ``partial`` and the host is short), evicting LRU ones."""
    host = state.host
    if partial:
        n = min(n, host.num_available)
    victims: list[tuple[int, bytes]] = []
    take = host.take_pinned if pinned else host.take
    blocks = [take(victims) for _ in range(n)]
    assert all(b >= 0 for b in blocks), "host take ran out after the availability check"
    if victims:
        state.stats.host_evictions += len(victims)
        state.evicted_since_flush += len(victims)
        dlookup, stored = state.device.lookup, state.index.stored
        for _, k in victims:
            if k not in stored:
                state.stats.unstored_host_evictions += 1
                if k not in dlookup:
                    state.gone(k, Tier.HOST, Cause.EVICTED)
    return blocks


def host_copies(state: CacheState, pairs: list[tuple[int, bytes]], chain: list[bytes] | None = None) -> list[CopyPlan]:
    """Write-through: copy keyed device blocks to the host (skipping keys it has or gets).

    ``chain``: the keys from the root to the last of ``pairs``, refreshed when the copy lands
    (see ``completions._refresh_chain``)."""
    hlookup, inflight = state.host.lookup, state.copies.inflight
    pairs = [(b, k) for b, k in pairs if k not in hlookup and k not in inflight]
    if not pairs:
        return []
    dst = take_host(state, len(pairs), pinned=True, partial=True)
    if len(dst) < len(pairs):
        state.stats.skipped_copies += len(pairs) - len(dst)
        if chain:  # a request's write-through (an export has its own retry: fastkv.cache.handoff)
            _skip(state, pairs[len(dst):], chain)
    if not dst:
        return []
    src = [b for b, _ in pairs[:len(dst)]]
    for b in src:
        state.device.pin(b)
    keys = [k for _, k in pairs[:len(dst)]]
    plan = state.copies.open(CopyKind.SWAP_OUT, Purpose.WRITE_THROUGH, src=src, dst=dst, keys=keys)
    if chain:
        rec = state.copies.records[plan.plan_id]
        rec.chain = chain
        rec.held = _hold_parents(state, plan.plan_id, chain, set(keys))
    return [plan]


def _skip(state: CacheState, pairs: list[tuple[int, bytes]], chain: list[bytes]) -> None:
    """Remember write-throughs the host had no free block for (``retry_skipped`` makes them).
    Skipped for good, a block never reaches the host, nor the storage tier under THROUGH: a
    restart or another engine on the same store would miss it."""
    skipped = state.skipped_through
    for _, k in pairs:
        skipped[k] = chain
        skipped.move_to_end(k)
    while len(skipped) > state.device.capacity:  # the oldest are the likeliest gone from the device
        skipped.popitem(last=False)


def retry_skipped(state: CacheState) -> list[CopyPlan]:
    """The skipped write-throughs whose keys are still on the device only, oldest first, as many
    as the host has blocks for now."""
    skipped = state.skipped_through
    room = state.host.num_available if skipped else 0
    if not room:
        return []
    dlookup, hlookup, inflight = state.device.lookup, state.host.lookup, state.copies.inflight
    batches: dict[int, tuple[list[bytes], list[tuple[int, bytes]]]] = {}  # by chain: one plan each
    while skipped and room:
        k, chain = skipped.popitem(last=False)
        b = dlookup.get(k)
        if b is None or k in hlookup or k in inflight:
            continue  # evicted (or written back), or copied by another request's write-through
        batches.setdefault(id(chain), (chain, []))[1].append((b, k))
        room -= 1
    plans = [p for chain, pairs in batches.values() for p in host_copies(state, pairs, chain)]
    state.stats.late_copies += sum(len(p.dst) for p in plans)
    return plans


def _hold_parents(state: CacheState, pid: int, chain: list[bytes], own: set[bytes]) -> list[int]:
    """Hold the host copies of the chain's other keys until the plan lands: host LRU eviction
    cannot see children in flight to the host, and a parent it evicted meanwhile would strand
    them there and their device sources. A parent still in flight to the host is held when it
    lands (``CopyBook.awaited``, settled in completions.py)."""
    inflight, awaited = state.copies.inflight, state.copies.awaited
    held, missing = state.host.hold_keys(chain, own)
    for k in missing:
        if k in inflight:
            awaited.setdefault(k, []).append(pid)
    return held


def count_hits(state: CacheState, req: CacheRecord, nd: int) -> list[CopyPlan]:
    hits, threshold, hot = state.hits, state.config.selective_hits, []
    for i in range(nd):
        k = req.keys[i]
        c = hits.get(k, 0) + 1
        hits[k] = c
        if c == threshold:
            hot.append((req.table[i], k))
    return host_copies(state, hot, req.keys[:nd]) if hot else []


def swap_in(state: CacheState, req: CacheRecord) -> CopyPlan:
    """Phase two of a prefix hit or a restore: host -> device, once loads and write-backs
    of this request are done (its SWAP_IN may overwrite a block a write-back was reading)."""
    src = ready_run(req.swap_src)
    dst = [req.table[i] for i in req.swap_pos[:len(src)]]
    for b in src:
        state.host.pin(b)
    for b in dst:
        state.device.pin(b)
    req.pending += 1
    plan = state.copies.open(CopyKind.SWAP_IN, Purpose.SWAP_IN, src=src, dst=dst, req=req,
                            positions=req.swap_pos[:len(dst)])
    req.swap_src = []
    req.swap_pos = []
    return plan


def ready_run(swap_src: list[int]) -> list[int]:
    """The leading host blocks of ``swap_src`` that are there (-1: a load that failed)."""
    for i, b in enumerate(swap_src):
        if b < 0:
            return swap_src[:i]
    return swap_src


def store(state: CacheState, blocks: list[int], keys: list[bytes]) -> list[CopyPlan]:
    stored = state.index.stored
    pairs = [(b, k) for b, k in zip(blocks, keys, strict=True) if k not in stored]
    if not pairs:
        return []
    for b, _ in pairs:
        state.host.pin(b)
    return [state.copies.open(CopyKind.STORE, Purpose.STORE, src=[b for b, _ in pairs],
                             keys=[k for _, k in pairs])]

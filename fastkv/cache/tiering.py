"""Blocks between tiers: where fresh blocks come from and the copies that move keyed bytes.

Taking fresh blocks evicts LRU ones; a device victim whose key has no other copy is written
back to the host (WRITE_BACK, and under any policy when children of it are on the host: it
would strand them) in a plan its new owner waits for, or its key is gone. The other
helpers open the write-through, swap-in and store plans. Every function takes the cache state and
only opens plans (pinning their blocks); completions.py settles them.
"""
from __future__ import annotations

from collections.abc import Sequence

from fastkv.cache.copies import Purpose
from fastkv.cache.index import Cause
from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.cache.pool import BlockState
from fastkv.cache.requests import CacheRecord
from fastkv.cache.state import CacheState
from fastkv.cache.write_policy import Tier

_CACHED = int(BlockState.CACHED)


def take_device(state: CacheState, n: int, owner: CacheRecord) -> tuple[list[int], CopyPlan | None]:
    """Fresh device blocks for ``owner``; evicted blocks without another copy are written back
    (WRITE_BACK) in a plan ``owner`` waits for, since it will overwrite them."""
    victims: list[tuple[int, bytes]] = []
    blocks = state.device.take_many(n, victims)
    if not victims:
        return blocks, None
    state.stats.device_evictions += len(victims)
    hlookup, stored, inflight = state.host.lookup, state.index.stored, state.copies.inflight
    host_kids = state.host.kids
    if not hlookup and not stored and not state.write_back and not host_kids:  # every victim's key is gone
        state.stats.dropped_keys += len(victims)
        state.index.gone_many([k for _, k in victims], Tier.DEVICE, Cause.EVICTED)
        if state.policy.copies_on_hit:
            state.through.forget_hits([k for _, k in victims])
        return blocks, None
    src: list[int] = []
    keys: list[bytes] = []
    if state.policy.copies_on_hit:
        state.through.forget_hits([k for _, k in victims])
    for b, k in victims:
        if k in hlookup or k in inflight:  # on the host, or on its way there (a second copy would race it)
            continue
        if state.write_back or k in host_kids:  # a parent of host blocks leaves the device for the host
            src.append(b)
            keys.append(k)
        elif k not in stored:
            state.gone(k, Tier.DEVICE, Cause.EVICTED)
    if not src:
        return blocks, None
    make_host_room(state, len(src), keep=owner)
    dst = take_host(state, len(src), pinned=True, partial=True, keys=keys)
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


def take_host(state: CacheState, n: int, pinned: bool, partial: bool = False, keys: Sequence[bytes] = ()) -> list[int]:
    """``n`` host blocks (fewer if ``partial`` and the host is short), evicting LRU ones.
    ``keys``: what the copy into them brings; their parents on the host wait for them already
    (the plan, opened once it has its blocks, holds them from then on)."""
    host = state.host
    if partial:
        n = min(n, host.num_available)
    victims: list[tuple[int, bytes]] = []
    take = host.take_pinned if pinned else host.take
    expected = host.expect(keys) if keys and len(host.free) < n else None  # only an eviction needs it
    blocks = [take(victims) for _ in range(n)]
    if expected:
        host.unexpect(expected)
    assert None not in blocks, "host take ran out after the availability check"
    if victims:
        state.stats.host_evictions += len(victims)
        state.flush.count(len(victims))
        dlookup, stored = state.device.lookup, state.index.stored
        for _, k in victims:
            if k not in stored:
                state.stats.unstored_host_evictions += 1
                if k not in dlookup:
                    state.gone(k, Tier.HOST, Cause.EVICTED)
    return blocks


def host_copies(state: CacheState, pairs: list[tuple[int, bytes]], chain: list[bytes] | None = None) -> list[CopyPlan]:
    """Write-through: copy keyed device blocks to the host (skipping keys it has or gets).

    ``chain``: the keys from the root to the last of ``pairs``. The plan holds the host copies
    of the chain's other keys until it lands, and refreshes the chain then (see
    ``completions._refresh_chain``): a walk of the whole chain, for copies no running request
    owns (``request_copies`` is the per-block-fill path)."""
    plan = _write_through(state, pairs, lambda: chain)
    if plan is None:
        return []
    if chain:
        rec = state.copies.records[plan.plan_id]
        rec.holds_chain(chain, _hold_parents(state, plan.plan_id, chain, set(rec.keys)))
    return [plan]


def request_copies(state: CacheState, req: CacheRecord, pairs: list[tuple[int, bytes]], end: int) -> list[CopyPlan]:
    """Write-through of a running request's blocks, ``pairs`` among its first ``end`` (its chain
    up to them). The request holds the host copies of its chain until it lets go of its device
    table (``hold_chain``), so its copies need no hold and no refresh of their own: a block fill
    costs the same at any context length. Should it let go while they fly, each gets the hold
    of its own then (``release_chain``)."""
    hold_chain(state, req, end)
    plan = _write_through(state, pairs, lambda: req.keys[:end])
    if plan is None:
        return []
    state.copies.records[plan.plan_id].owned_by(req, end)
    req.chain.own(plan.plan_id)
    return [plan]


def _write_through(state: CacheState, pairs: list[tuple[int, bytes]], chain) -> CopyPlan | None:
    """The SWAP_OUT of ``pairs`` the host has no copy of (none coming), as far as it has blocks
    for; ``chain()`` gives the chain to retry the rest with."""
    hlookup, inflight = state.host.lookup, state.copies.inflight
    pairs = [(b, k) for b, k in pairs if k not in hlookup and k not in inflight]
    if not pairs:
        return None
    dst = take_host(state, len(pairs), pinned=True, partial=True, keys=[k for _, k in pairs])
    if len(dst) < len(pairs):
        state.stats.skipped_copies += len(pairs) - len(dst)
        keys = chain()
        if keys:  # a request's write-through (an export has its own retry: fastkv.cache.handoff)
            _skip(state, pairs[len(dst):], keys)
    if not dst:
        return None
    src = [b for b, _ in pairs[:len(dst)]]
    for b in src:
        state.device.pin(b)
    keys = [k for _, k in pairs[:len(dst)]]
    return state.copies.open(CopyKind.SWAP_OUT, Purpose.WRITE_THROUGH, src=src, dst=dst, keys=keys)


def _skip(state: CacheState, pairs: list[tuple[int, bytes]], chain: list[bytes]) -> None:
    """Remember write-throughs the host had no free block for (``retry_skipped`` makes them).
    Skipped for good, a block never reaches the host, nor the storage tier under THROUGH: a
    restart or another engine on the same store would miss it."""
    state.through.skip([k for _, k in pairs], chain, state.device.capacity)


def retry_skipped(state: CacheState) -> list[CopyPlan]:
    """The skipped write-throughs whose keys are still on the device only, oldest first, as many
    as the host has blocks for now."""
    through = state.through
    room = state.host.num_available if through.skipped else 0
    if not room:
        return []
    dlookup, hlookup, inflight = state.device.lookup, state.host.lookup, state.copies.inflight
    batches: dict[int, tuple[list[bytes], list[tuple[int, bytes]]]] = {}  # by chain: one plan each
    while through.skipped and room:
        k, chain = through.oldest_skipped()
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
    copies = state.copies
    held, missing = state.host.hold_keys(chain, own)
    for k in missing:
        if k in copies.inflight:
            copies.await_parent(k, pid)
    return held


def hold_chain(state: CacheState, req: CacheRecord, end: int) -> None:
    """Extend the request's hold on the host copies of its chain to its first ``end`` keys.

    A running request holds them as it holds its device blocks: out of the host's eviction
    queue, so neither can a parent be evicted under a child in flight (the reason a plan holds
    its chain), nor do its copies age while it runs, and a block fill does not walk the whole
    chain to refresh it. Each key is looked at once per hold: the keys up to
    ``chain.upto`` were, and its own copies join as they land. A key still in flight to the
    host is held when it lands; one that comes later by another way (another request's copy)
    is not held, only ordered when the request lets go (``release_chain``)."""
    chain = req.chain
    start = chain.upto
    if end <= start:
        return
    held, missing = state.host.hold_keys(req.keys[start:end], ())
    state.through.holding(req, chain.extend(held, end))
    copies = state.copies
    for k in missing:
        if k in copies.inflight:
            copies.await_parent(k, (req, chain.gen))


def release_chain(state: CacheState, req: CacheRecord, touch: bool = False) -> bool:
    """The request lets go of its device table, or of this hold alone for host room
    (``make_host_room``; its next block fill holds the chain anew): its write-throughs still in
    flight take the hold on their parents a plan of no request takes (``_hold_parents``), then
    its chain's host copies go back to the eviction queue leaves first (the leaves-first
    contract of fastkv.cache.eviction), with ``touch`` its other host copies too (a request's
    release refreshes them: ``release.release_table``). The walk is the chain's length, once
    per hold. False: it held nothing, and walked nothing."""
    if not req.chain.held:
        return False
    held, plans = req.chain.let_go()
    state.through.let_go(req)
    records = state.copies.records
    for pid in plans:
        rec = records[pid]
        chain = req.keys[:rec.chain_end]
        rec.orphaned(chain, _hold_parents(state, pid, chain, set(rec.keys)))
    host = state.host
    mine = set(held)
    assert len(mine) == len(held), f"request {req.rid!r} holds a host block of its chain twice"
    hget, release, refresh = host.lookup.get, host.release, host.touch
    for k in reversed(req.keys):  # one pass, so that held and cached copies queue in one order
        b = hget(k)
        if b is None:
            continue
        if b in mine:
            mine.discard(b)
            release(b)
        elif touch:
            refresh(b)
    for b in mine:  # keys that are not the request's any more (no caller leaves any): any order
        release(b)
    return True


def make_host_room(state: CacheState, n: int, holding: Sequence[int] = (), keep: CacheRecord | None = None) -> int:
    """Host blocks a take of ``n`` can have once the caller holds ``holding`` (its cached ones
    leave the eviction queue then): available blocks less those. Short of ``n``, running requests
    (not ``keep``) let go of their chain holds first, the least recently extended first, until
    it is not: a write-back, an offload or a storage hit's staging block may evict their
    copies, which then queue at the young end, leaves first. A write-through does not make room
    so: with the host full of running requests' copies, taking one's would only lose it a copy
    another needs as much (the copy is made later, or written back), and each such request
    would walk its chain again to hold it anew."""
    host = state.host
    hstate = host.state

    def room() -> int:
        return host.num_available - sum(1 for b in holding if hstate[b] == _CACHED)

    left = room()
    if left < n:
        for req in [r for r in state.through.holders.values() if r is not keep]:
            release_chain(state, req)
            state.stats.chain_spills += 1
            left = room()
            if left >= n:
                break
    return left


def count_hits(state: CacheState, req: CacheRecord, num_device_hits: int) -> list[CopyPlan]:
    """WRITE_THROUGH_SELECTIVE: a device hit's block is copied to the host on its
    ``selective_hits``-th hit."""
    count, threshold, hot = state.through.count_hit, state.config.selective_hits, []
    for i in range(num_device_hits):
        k = req.keys[i]
        if count(k) == threshold:
            hot.append((req.table[i], k))
    return request_copies(state, req, hot, num_device_hits) if hot else []


def swap_in(state: CacheState, req: CacheRecord) -> CopyPlan:
    """Phase two of a prefix hit or a restore: host -> device, once loads and write-backs
    of this request are done (its SWAP_IN may overwrite a block a write-back was reading)."""
    src, positions = req.load.take_swap()
    dst = [req.table[i] for i in positions]
    for b in src:
        state.host.pin(b)
    for b in dst:
        state.device.pin(b)
    req.pending += 1
    return state.copies.open(CopyKind.SWAP_IN, Purpose.FILL, src=src, dst=dst, req=req, positions=positions)


def store(state: CacheState, blocks: list[int], keys: list[bytes]) -> list[CopyPlan]:
    stored = state.index.stored
    pairs = [(b, k) for b, k in zip(blocks, keys, strict=True) if k not in stored]
    if not pairs:
        return []
    for b, _ in pairs:
        state.host.pin(b)
    return [state.copies.open(CopyKind.STORE, Purpose.STORE, src=[b for b, _ in pairs],
                             keys=[k for _, k in pairs])]

"""What the cache manager does when a copy finishes, per purpose.

Common rules: destination blocks get their keys only if the copy succeeded (a failed copy
never leaves a key on bad bytes) and before they are unpinned (so they enter the LRU queue as
CACHED); every pin the plan took is dropped exactly once; a request freed while its copy was
in flight is not touched (its blocks were released then and settle here as their pins drop,
so a plan in table order is unpinned last to first: children enter the LRU queue before their
parents, the leaves-first contract of fastkv.cache.eviction).
"""
from __future__ import annotations

from fastkv.cache.copies import CopyRecord, Purpose
from fastkv.cache.index import Cause
from fastkv.cache.plan import Completion, CopyPlan, Ready
from fastkv.cache.pool import BlockState
from fastkv.cache.release import release_host_refs, release_table
from fastkv.cache.requests import CacheRecord, LoadProgress, ReqState
from fastkv.cache.state import CacheState
from fastkv.cache.storage_writes import catch_up, landed_stores, offload_stores
from fastkv.cache.strands import parent_present, present
from fastkv.cache.tiering import swap_in
from fastkv.cache.write_policy import Tier

_CACHED = int(BlockState.CACHED)


def finish(state: CacheState, rec: CopyRecord, ok: bool) -> Completion:
    plans: list[CopyPlan] = []
    ready: list[Ready] = []
    offloaded: list[object] = []
    failed: list[object] = []
    p = rec.purpose
    if p is Purpose.WRITE_BACK or p is Purpose.WRITE_THROUGH:
        plans += _landed_on_host(state, rec, ok)
        if p is Purpose.WRITE_BACK:
            _progress(state, rec.req, plans, ready)
    elif p is Purpose.PREFIX_LOAD:
        _loaded(state, rec, ok)
        for req, _ in rec.waiters:
            _progress(state, req, plans, ready)
    elif p is Purpose.FILL:
        for b in reversed(rec.src):
            state.host.unpin(b)
        for b in reversed(rec.dst):
            state.device.unpin(b)
        if not ok and rec.req is not None and rec.req.alive:
            rec.req.load.failed_at(rec.positions[0])
        _progress(state, rec.req, plans, ready)
    elif p is Purpose.OFFLOAD:
        plans += _offloaded(state, rec, ok, offloaded, failed)
    elif p is Purpose.STORE:
        for b in rec.src:
            state.host.unpin(b)
        state.stats.store_blocks += len(rec.src) if ok else 0
        if ok:
            for k in rec.keys:
                state.index.remember_stored(k)
        plans += catch_up(state)
    else:
        assert p is Purpose.CONTROL, f"completion of unknown purpose {p!r}"
    return Completion(tuple(plans), tuple(ready), tuple(offloaded), tuple(failed))


def _progress(state: CacheState, req: CacheRecord | None, plans: list[CopyPlan], ready: list[Ready]) -> None:
    """One fewer copy for the request to wait for; the last one issues its swap-in or readies it."""
    if req is None or not req.alive:
        return
    req.pending -= 1
    assert req.pending >= 0, f"request {req.rid!r}: more completions than plans"
    if req.pending:
        return
    load = req.load
    if load is not None and load.swappable() and req.state is ReqState.RUNNING:
        plans.append(swap_in(state, req))
    else:
        if load is not None:
            load.drop_swap()
        ready.append(make_ready(state, req))


def _set_host_keys(state: CacheState, rec: CopyRecord, stranded: list[bytes]) -> list[tuple[int, bytes]]:
    """Key the blocks that landed, in ``rec``'s order; a key whose parent left every tier
    meanwhile is not keyed (it could never be matched) but listed in ``stranded``."""
    host = state.host
    pairs = list(zip(rec.dst, rec.keys, strict=True))
    leaves_first = rec.purpose is Purpose.WRITE_BACK
    if leaves_first:  # parents first, so that each finds its parent keyed
        pairs.reverse()
    keyed = []
    late = None
    for hb, k in pairs:
        if parent_present(state, k):
            if host.set_key(hb, k):
                keyed.append((hb, k))
        elif late is None:
            late = [(hb, k)]
        else:
            late.append((hb, k))
    while late:  # parents later in the plan (rare): keyed once theirs are
        left = []
        for hb, k in late:
            if not parent_present(state, k):
                left.append((hb, k))
            elif host.set_key(hb, k):
                keyed.append((hb, k))
        if len(left) == len(late):
            stranded += [k for _, k in left]
            break
        late = left
    if leaves_first:
        keyed.reverse()
    return keyed


def _landed_on_host(state: CacheState, rec: CopyRecord, ok: bool) -> list[CopyPlan]:
    """A write-back or write-through SWAP_OUT finished."""
    dev, host, stats = state.device, state.host, state.stats
    for b in rec.src:
        dev.unpin(b)
    stranded: list[bytes] = []
    keyed = _set_host_keys(state, rec, stranded) if ok else []
    _hand_to_waiting_children(state, rec, keyed)
    owner = rec.owner
    if owner is not None:  # it holds its chain (tiering.request_copies): these join the hold, unqueued
        owner.chain.landed(rec.plan.plan_id)
        for hb, _ in keyed:
            host.incref(hb)
            owner.chain.join(hb)
    # children first: a batch enters the host LRU queue leaves before parents
    order = rec.dst if rec.purpose is Purpose.WRITE_BACK else rec.dst[::-1]
    for hb in order:
        host.unpin(hb)
    if rec.held is not None:  # leaves first, as the refresh below would order them
        host.release_many(rec.held[::-1])
    if ok and rec.chain:
        _refresh_chain(state, rec.chain, host_too=not _queued_in_order(state, rec, keyed),
                       device_too=any(dev.state[b] == _CACHED for b in rec.src))
    if ok:
        stats.swap_out_blocks += len(rec.src)
    else:  # a write-through's source was its last copy only if a loss had unkeyed it (strands.py)
        for k in rec.keys:
            state.gone_if_last(k, Tier.DEVICE, Cause.COPY_FAILED, skip=Tier.STORAGE)
    for k in stranded:
        state.gone_if_last(k, Tier.HOST, Cause.STRANDED, skip=Tier.STORAGE)
    return landed_stores(state, [hb for hb, _ in keyed], [k for _, k in keyed])


def _hand_to_waiting_children(state: CacheState, rec: CopyRecord, keyed: list[tuple[int, bytes]]) -> None:
    """Write-throughs of this plan's children hold the blocks it landed (tiering._hold_parents)."""
    copies, host = state.copies, state.host
    if not copies.awaited:
        return
    records = copies.records
    landed = {k: hb for hb, k in keyed}
    for k in rec.keys:
        waiting, hb = copies.take_awaiting(k), landed.get(k)
        if hb is None:
            continue  # it failed to land: nothing to hold
        for holder in waiting:
            if type(holder) is int:
                child = records.get(holder)
                if child is not None:
                    host.incref(hb)
                    child.hold_landed(hb)
                continue
            req, gen = holder
            if req.chain.gen == gen and req.chain.held:
                host.incref(hb)
                req.chain.join(hb)


def _queued_in_order(state: CacheState, rec: CopyRecord, keyed: list[tuple[int, bytes]]) -> bool:
    """Whether the chain's host blocks are exactly the ones this plan landed and the parents it
    held: then their unpins and releases just queued them leaves first, and the host needs no
    refresh (the refresh touches the whole chain, a cost per block fill that grows with the
    context). Any other chain key on the host (it arrived meanwhile) takes the full refresh."""
    if rec.held is None:
        return False
    hget = state.host.lookup.get
    on_host = {hget(k) for k in rec.chain}
    on_host.discard(None)
    return on_host == {*rec.held, *(hb for hb, _ in keyed)}


def _refresh_chain(state: CacheState, chain: list[bytes], host_too: bool = True, device_too: bool = True) -> None:
    """A write-through landed after its chain's earlier plans (parents first on the host) and
    unpinned its device sources (back at the young end of the device queue): refresh the
    chain's blocks in both tiers leaves first, so that eviction takes children first again.
    Not the host's when the plan held its parents there: their release just queued them so.
    Not the device's while the request still holds its sources: its own blocks are not queued
    there, and only sources it let go of during the copy went back to the queue."""
    pools = [pool for pool, due in ((state.host, host_too), (state.device, device_too)) if due]
    for pool in pools:
        lookup, touch = pool.lookup, pool.touch
        for k in reversed(chain):
            b = lookup.get(k)
            if b is not None:
                touch(b)


def _loaded(state: CacheState, rec: CopyRecord, ok: bool) -> None:
    """A PREFIX_LOAD landed for its owner and every request that joined it (copies.join)."""
    host = state.host
    stranded: list[bytes] = []
    if ok:
        state.stats.load_blocks += len(rec.dst)
        _set_host_keys(state, rec, stranded)
    for req, slots in rec.waiters:
        if not req.alive:
            continue
        load = req.load
        if not ok:
            load.failed_at(load.swap_pos[min(slots.values())])
            continue
        for i, slot in slots.items():  # each holds the staged block until its swap-in is done
            hb = rec.dst[i]
            host.incref(hb)
            req.host_refs.append(hb)
            load.landed(slot, hb)
    for hb in reversed(rec.dst):
        host.unpin(hb)
    if not ok:
        state.stats.load_misses += len(rec.dst)
        for k in rec.keys:
            state.index.forget_stored(k)
            state.gone_if_last(k, Tier.STORAGE, Cause.STORAGE_MISS, skip=Tier.STORAGE)
    for k in stranded:
        state.gone_if_last(k, Tier.HOST, Cause.STRANDED, skip=Tier.STORAGE)


def _offloaded(state: CacheState, rec: CopyRecord, ok: bool, offloaded: list, failed: list) -> list[CopyPlan]:
    dev, host, req = state.device, state.host, rec.req
    keyed: list[tuple[int, bytes]] = []
    if ok:
        state.stats.swap_out_blocks += len(rec.src)
        chain = None if req.alive else {k: i for i, k in enumerate(req.keys)}
        for hb, k in zip(rec.dst, rec.keys, strict=True):
            private = k == req.resume.private_key
            if chain is not None:  # freed meanwhile: no table holds its chain, so only under a parent
                i = chain.get(k)
                if private or i is None or i and not present(state, req.keys[i - 1]):
                    continue
                state.index.learn_at(req.keys, [i])
            if host.set_key(hb, k) and not private:
                keyed.append((hb, k))
    for b in reversed(rec.src):
        dev.unpin(b)
    for hb in reversed(rec.dst):
        host.unpin(hb)
    if req.alive:
        req.pending = 0
        if ok:
            finish_offload(state, req)
            offloaded.append(req.rid)
        else:
            release_host_refs(state, req)
            req.state = ReqState.RUNNING
            failed.append(req.rid)
    return offload_stores(state, req, keyed) if ok else []


def make_ready(state: CacheState, req: CacheRecord) -> Ready:
    """All copies ``req`` waited for are done. After a load or restore, key the blocks that
    arrived, up to the first failed one, and let go of the host copies."""
    load = req.load
    if load is None:
        return Ready(req.rid, req.num_computed)
    req.load = None
    bs = state.block_size
    valid = load.valid_tokens(bs)
    n_full = min(valid // bs, len(req.keys))
    dev = state.device
    todo = [i for i in range(req.num_keyed, n_full) if dev.key[req.table[i]] is None]
    state.index.learn_at(req.keys, todo)
    dups = dev.insert_many([req.table[i] for i in todo], [req.keys[i] for i in todo])
    req.dup_pos += [todo[j] for j in dups]
    state.stats.duplicate_blocks += len(dups)
    _count_served_hits(state, req, load, valid)
    req.num_keyed = max(req.num_keyed, n_full)
    req.num_computed = valid
    refs = req.host_refs
    release_host_refs(state, req)
    if not state.policy.host_inclusive:  # write-back keeps the host exclusive
        host, dlookup = state.host, dev.lookup
        for hb in refs:
            k = host.key[hb]
            if k is not None and k in dlookup and host.state[hb] == _CACHED:
                host.evict(hb)
    return Ready(req.rid, valid)


def _count_served_hits(state: CacheState, req: CacheRecord, load: LoadProgress, valid: int) -> None:
    """Credits the host and storage hits of a prefix load with the tokens that arrived: they
    follow the device hits in that order, and ``valid`` ends at the first failed block."""
    host_hits, storage_hits = load.planned_hits
    if not host_hits and not storage_hits:
        return
    bs, stats, target = state.block_size, state.stats, load.target_computed
    served = max(0, valid - req.num_keyed * bs)
    host = min(served, host_hits * bs)
    planned = target - min(target, (req.num_keyed + host_hits) * bs)  # ends at a resumed partial
    storage = min(served - host, planned)
    stats.host_hit_tokens += host
    stats.storage_hit_tokens += storage
    stats.storage_lost_tokens += planned - storage


def finish_offload(state: CacheState, req: CacheRecord) -> None:
    """The offload copy landed (or nothing needed copying): the device blocks go back."""
    release_table(state, req, True)
    state.reservations.take_back(req)
    req.state = ReqState.OFFLOADED

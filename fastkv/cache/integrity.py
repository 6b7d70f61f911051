"""check_integrity() of the cache state: every invariant, recomputed from scratch.

Slow (linear in blocks, requests and copies) and meant for tests and debugging."""
from __future__ import annotations

from collections import Counter

from fastkv.cache.copies import Purpose
from fastkv.cache.pool import BlockState
from fastkv.cache.requests import ReqState
from fastkv.cache.state import CacheState
from fastkv.config import cdiv

_CACHED = int(BlockState.CACHED)

# Which side of a plan pins which tier, per purpose: (device pins, host pins) as "src"/"dst".
_PINS = {
    Purpose.WRITE_BACK: ("src", "dst"),
    Purpose.WRITE_THROUGH: ("src", "dst"),
    Purpose.OFFLOAD: ("src", "dst"),
    Purpose.FILL: ("dst", "src"),
    Purpose.PREFIX_LOAD: (None, "dst"),
    Purpose.STORE: (None, "src"),
    Purpose.CONTROL: (None, None),
}


def check(state: CacheState) -> None:
    dev, host, bs = state.device, state.host, state.block_size
    dev.check_integrity()
    host.check_integrity()
    _child_counts(state)
    _no_key_stranded(state)

    dev_refs: Counter[int] = Counter()
    host_refs: Counter[int] = Counter()
    reserved = 0
    for rid, req in state.reqs.items():
        assert req.alive and req.rid == rid, f"request {rid!r}: record mismatch"
        assert 0 <= req.num_computed <= req.num_tokens, f"request {rid!r}: computed {req.num_computed} > tokens"
        assert len(req.keys) == req.num_tokens // bs, f"request {rid!r}: {len(req.keys)} keys, {req.num_tokens} tokens"
        assert len(req.tail) == req.num_tokens - len(req.keys) * bs, f"request {rid!r}: tail length"
        assert req.num_keyed <= len(req.keys), f"request {rid!r}: keyed beyond its full blocks"
        assert req.pending >= 0 and req.reserved >= 0
        reserved += req.reserved
        if req.state is ReqState.OFFLOADED:
            assert not req.table and req.pending == 0, f"request {rid!r}: OFFLOADED but holds device blocks"
            assert len(req.host_refs) == cdiv(req.num_computed, bs), f"request {rid!r}: host table length"
        else:
            assert len(req.table) == cdiv(req.num_tokens, bs), \
                f"request {rid!r}: {len(req.table)} blocks for {req.num_tokens} tokens"
        if req.state is ReqState.OFFLOADING:
            assert req.pending == 1, f"request {rid!r}: OFFLOADING with {req.pending} pending copies"
        for i, b in enumerate(req.table):
            dev_refs[b] += 1
            k = dev.key[b]
            if k is not None and i < len(req.keys):
                assert k == req.keys[i], f"request {rid!r}: block {b} at {i} carries another key"
            if i < req.num_keyed and req.load is None:
                assert k is None or k == req.keys[i], f"request {rid!r}: keyed block {i} lost its key"
        for b in req.host_refs:
            host_refs[b] += 1
        if req.chain.held:
            assert req.table, f"request {rid!r} holds its chain's host copies without its device table"
            host_refs.update(req.chain.blocks)
        else:
            assert not req.chain.plans and req.chain.upto == 0, f"request {rid!r}: write-throughs owned without a hold"
        for pid in req.chain.plans:
            rec = state.copies.records.get(pid)
            assert rec is not None and rec.owner is req, f"request {rid!r}: owned write-through {pid} not in flight"
        assert len(set(req.table)) == len(req.table), f"request {rid!r}: a block twice in its table"
    for b, _ in state.handoff_holds.values():
        dev_refs[b] += 1
    for rec in state.copies.records.values():
        host_refs.update(rec.held or ())
    total = state.reservations.total
    assert reserved == total, f"reserved {total} != sum over requests {reserved}"
    for pool, refs in ((dev, dev_refs), (host, host_refs)):
        for b in range(pool.capacity):
            assert pool.ref[b] == refs[b], f"{pool.tier} block {b}: refcount {pool.ref[b]} but {refs[b]} holders"
            if refs[b]:
                assert pool.state[b] in (BlockState.ALLOCATED, BlockState.IN_FLIGHT), \
                    f"{pool.tier} block {b} held by a request but {BlockState(pool.state[b]).name}"

    dev_pins: Counter[int] = Counter()
    host_pins: Counter[int] = Counter()
    inflight, loading = {}, {}
    for pid, rec in state.copies.records.items():
        assert rec.plan.plan_id == pid
        d_side, h_side = _PINS[rec.purpose]
        if d_side:
            dev_pins.update(getattr(rec, d_side))
        if h_side:
            host_pins.update(getattr(rec, h_side))
        if rec.purpose in (Purpose.WRITE_BACK, Purpose.WRITE_THROUGH):
            for k in rec.keys:
                inflight[k] = pid
        for req in [rec.req] + [r for r, _ in rec.waiters or ()]:
            if req is not None and req.alive:
                assert req.pending > 0, f"plan {pid} for request {req.rid!r}, which waits for nothing"
        if rec.purpose is Purpose.PREFIX_LOAD:
            for i, k in enumerate(rec.keys):
                loading[k] = (pid, i)
    assert inflight == state.copies.inflight, "in-flight keys do not match the open write-back/through plans"
    assert loading == state.copies.loading, "loading keys do not match the open prefix loads"
    for k, holders in state.copies.awaited.items():
        assert k in inflight, "a write-through waits for a parent key no copy brings"
        for p in holders:  # a plan that landed first stays listed until the key lands: ids are never reused
            if type(p) is not int:
                continue  # a request's chain hold (void if it let go since: ChainHold.gen)
            rec = state.copies.records.get(p)
            assert rec is None or rec.purpose is Purpose.WRITE_THROUGH, "a parent key awaited by a non-write-through"
    for pid, rec in state.copies.records.items():
        if rec.owner is not None:
            assert rec.owner.alive and pid in rec.owner.chain.plans, f"write-through {pid}: its owner does not list it"
    for pool, pins in ((dev, dev_pins), (host, host_pins)):
        for b in range(pool.capacity):
            assert pool.pins[b] == pins[b], f"{pool.tier} block {b}: {pool.pins[b]} pins but {pins[b]} copies"
    assert len(state.index.stored) <= state.index.storage_keys
    assert len(state.index.history) <= 2 * state.index.history_size


def _no_key_stranded(state: CacheState) -> None:
    """No CACHED key whose parent is in no tier (nor on its way to one), whatever was lost:
    eviction goes leaves first (pool.py), and a loss drops the children it strands (strands.py)."""
    dev, host = state.device, state.host
    present = (dev.lookup, host.lookup, state.index.stored, state.copies.inflight, state.copies.loading)
    for pool in (dev, host):
        for b, pk in enumerate(pool.parent):
            if pk is not None and pool.state[b] == _CACHED:
                assert any(pk in where for where in present), \
                    f"{pool.tier} block {b}: a cached key stranded behind a parent in no tier"


def _child_counts(state: CacheState) -> None:
    """Each pool lists, per parent key, its keyed children (BlockPool.check_integrity checks
    which) and those copies bring to it; and every operation dropped the children its losses
    stranded before it returned (strands.settles)."""
    assert not state.lost, f"losses left unsettled: {state.lost}"
    for pool in (state.device, state.host):
        kids: Counter[bytes] = Counter(pk for pk in pool.parent if pk is not None)
        if pool is state.host:
            kids.update(pk for rec in state.copies.records.values() for pk in rec.expected or ())
        listed = Counter({pk: len(pool.children(pk)) for pk in pool.kids})
        assert kids == listed, f"{pool.tier}: child counts {dict(listed)} != {dict(kids)}"

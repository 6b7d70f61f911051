"""Preemption by copy: offload a request's KV to the host, restore it onto the device later.

``offload`` copies every block holding computed KV to the host (the partial last block under a
private key, so that no other request can match it); the request is OFFLOADING until the copy
completes, then OFFLOADED with no device blocks. ``restore`` gives it device blocks again,
reusing those of its keys still cached on the device and swapping in the rest from its host
copies. Offloading a request whose restore is still loading needs no copy: it is OFFLOADED
again on the host copies it kept. CacheManager.offload / restore delegate here; completions.py
finishes the copies.
"""
from __future__ import annotations

import numpy as np

from fastkv.cache.completions import finish_offload, make_ready
from fastkv.cache.copies import Purpose
from fastkv.cache.keys import private_key, resume_key
from fastkv.cache.plan import Allocation, CopyKind, CopyPlan, PreemptionWork
from fastkv.cache.pool import BlockState
from fastkv.cache.requests import CacheRecord, LoadProgress, ReqState
from fastkv.cache.state import CacheState
from fastkv.cache.storage_writes import offload_stores
from fastkv.cache.tiering import make_host_room, swap_in, take_device, take_host
from fastkv.config import cdiv

_CACHED = int(BlockState.CACHED)


def offload(state: CacheState, request_id: object, to_storage: bool = False) -> tuple[CopyPlan, ...] | None:
    """Copy every block holding computed KV (the partial last one too, under a private key)
    to the host. Returns the plans to hand out; the device blocks are released when the copy
    completes (Completion.offloaded). When nothing needed copying (or its restore was still
    loading) the request is OFFLOADED now (``CacheManager.is_offloaded``), and the plans are
    only its STOREs, if any. None: not enough host blocks now. ``to_storage``
    (storage-mode preemption): its blocks are also STOREd, the partial one under its resume
    key, which it keeps on the host too (see storage_writes.py)."""
    req = state.get(request_id, ReqState.RUNNING)
    if req.restoring:
        _cancel_restore(state, req)
        return ()
    if req.pending:
        raise ValueError(f"request {request_id!r} has copies in flight: offload it once ready")
    host = state.host
    if not host.capacity:
        raise ValueError("offload needs a host tier (num_host_blocks > 0)")
    host_table, n_full = _host_copies(state, req)
    n_blocks = len(host_table)
    copy = [i for i in range(n_blocks) if host_table[i] is None]
    have = [hb for hb in host_table if hb is not None]
    if make_host_room(state, len(copy), have, keep=req) < len(copy):
        return None
    for hb in have:
        host.incref(hb)
    fresh = take_host(state, len(copy), pinned=False, keys=[req.keys[i] for i in copy if i < n_full])
    keys: list[bytes] = []
    epoch = state.preemptions.next_epoch()
    req.resume.begin_offload(to_storage)
    for i, hb in zip(copy, fresh, strict=True):
        host_table[i] = hb
        host.pin(hb)
        state.device.pin(req.table[i])
        if i < n_full:
            keys.append(req.keys[i])
        elif to_storage and (rk := partial_resume_key(state, req.rid, req.root, req.keys,
                                                       partial_tokens(req, state.block_size), req.num_computed)):
            req.resume.keyed(rk)  # request-scoped: only its own re-admission can match it, so it stays cached
            state.preemptions.remember_resume(req.rid, rk)
            keys.append(rk)
        else:
            parent = req.keys[i - 1] if i else req.root
            key = private_key(state.namespace, parent, req.rid, epoch, [i])
            req.resume.keyed(key, hb)
            keys.append(key)
    req.host_refs = host_table
    req.state = ReqState.OFFLOADING
    state.stats.offloads += 1
    if not copy:
        finish_offload(state, req)
        return tuple(offload_stores(state, req, []))
    req.pending = 1
    src = [req.table[i] for i in copy]
    return (state.copies.open(CopyKind.SWAP_OUT, Purpose.OFFLOAD, src=src, dst=fresh, keys=keys, req=req),)


def _host_copies(state: CacheState, req: CacheRecord) -> tuple[list[int | None], int]:
    """The host block holding each of the request's computed blocks (None: none), and how many
    of them are full (only full blocks have shared keys a host copy can be found by)."""
    n_full = min(req.num_computed // state.block_size, len(req.keys))
    hget = state.host.lookup.get
    table: list[int | None] = [None] * cdiv(req.num_computed, state.block_size)
    for i in range(n_full):
        table[i] = hget(req.keys[i])
    return table, n_full


def preemption_work(state: CacheState, request_id: object) -> PreemptionWork:
    """What preempting a RUNNING request would cost each way, given the host copies it has now
    (write-through puts its full blocks there): an offload copies only the blocks without one,
    a recompute computes again only the tokens after its leading blocks with a host copy, landed
    or on its way (its re-admission swaps those back in, if they are still there: those tokens
    are ``unheld_tokens``)."""
    req = state.get(request_id, ReqState.RUNNING)
    table, _ = _host_copies(state, req)
    landing = state.copies.inflight
    lead = next((i for i, hb in enumerate(table)
                 if hb is None and (i >= len(req.keys) or req.keys[i] not in landing)), len(table))
    kept = min(req.num_computed, lead * state.block_size)
    return PreemptionWork(sum(1 for hb in table if hb is None), req.num_computed - kept, kept)


def _cancel_restore(state: CacheState, req: CacheRecord) -> None:
    """Offload during a restore: its host copies are intact, so it is OFFLOADED again at once
    and nothing is recomputed. Its copies in flight finish for nobody, on blocks it let go of."""
    for rec in state.copies.records.values():
        if rec.req is req:
            rec.forsake()
    req.pending = 0
    req.load = None
    finish_offload(state, req)


def restore(state: CacheState, request_id: object, reserve_tokens: int = 0) -> Allocation | None:
    """Bring an OFFLOADED request back: device blocks for all its tokens, swapped in from
    its host copies (blocks still cached on the device are reused). None: not now."""
    req = state.get(request_id, ReqState.OFFLOADED)
    if state.paused:
        raise ValueError("restore during a weight update")
    bs = state.block_size
    n_blocks = cdiv(req.num_tokens, bs)
    n_res = cdiv(req.num_tokens + reserve_tokens, bs) - n_blocks
    n_full = min(req.num_computed // bs, len(req.keys))
    dev = state.device
    table: list[int | None] = [None] * n_blocks
    # only the leading run of blocks still on the device is reused: a failed swap-in then has
    # nothing but fresh blocks after it, and the recompute from there writes no shared block
    dget = dev.lookup.get
    for i in range(n_full):
        if (b := dget(req.keys[i])) is None:
            break
        table[i] = b
    reused = [b for b in table if b is not None]
    cached = sum(1 for b in reused if dev.state[b] == _CACHED)
    if dev.num_available - cached - state.reservations.total < n_blocks - len(reused) + n_res:
        return None
    for b in reused:
        dev.incref(b)
    fresh, write_back = take_device(state, n_blocks - len(reused), req)
    it = iter(fresh)
    req.table = [b if b is not None else next(it) for b in table]
    positions = [i for i in range(len(req.host_refs)) if table[i] is None]
    req.load = LoadProgress(req.num_computed, [req.host_refs[i] for i in positions], positions, restoring=True)
    req.num_keyed = 0
    req.dup_pos = []  # positions of the old table: make_ready finds the new one's duplicates
    req.state = ReqState.RUNNING
    state.reservations.promise(req, n_res)
    state.stats.restores += 1
    plans = [write_back] if write_back is not None else []
    req.pending = len(plans)
    if not plans:
        if positions:
            plans.append(swap_in(state, req))
        else:
            make_ready(state, req)
    return Allocation(tuple(req.table), len(reused) * bs, (n_blocks - len(reused)) * bs, tuple(plans),
                      req.pending == 0)


# ---- resume keys: a storage-mode preemption's partial block (keys.resume_key)
def partial_resume_key(state: CacheState, rid: object, root: bytes, keys: list[bytes], block: list[int] | None,
                       computed: int) -> bytes | None:
    """The resume key of a request whose first ``computed`` tokens hold KV, ``block`` the tokens
    of the block they end in (None: no partial block, or its tokens are not known)."""
    nf, r = divmod(computed, state.block_size)
    if not r or block is None:
        return None
    return resume_key(state.namespace, keys[nf - 1] if nf else root, state.run, rid,
                      np.asarray(block[:r], np.int32).tobytes())


def partial_tokens(req: CacheRecord, block_size: int) -> list[int] | None:
    """Tokens of the block its computed KV ends in, if the record still knows them."""
    nf = req.num_computed // block_size
    if nf == len(req.keys):
        return req.tail
    return req.resume.last_block if nf == len(req.keys) - 1 else None

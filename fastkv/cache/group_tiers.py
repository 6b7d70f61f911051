"""Offload and restore of a request across KV cache groups: each group moves only what it holds.

An offload copies, per group, the blocks the request's table holds there to that group's host
pool: a full group every block of its context, a sliding group only the blocks its next query
reads (at most ceil(w / bs) + 1 between steps). Resume is exact: those are all a sliding layer
reads from there on. Its life, driven by the caller, who runs each group's plan::

    offload(cache, rid)      -> [GroupCopy] | None     (None: a group's host lacks room; nothing changed)
    offloaded(cache, rid, ok)                          (the copies are done: the device blocks go)
    restore(cache, rid)      -> [GroupCopy] | None     (None: a group's device lacks room)
    restored(cache, rid, ok)                           (running again; a failed restore frees the request)

Host blocks are the request's own (unkeyed), and so are the device blocks a restore fills: they
are FREE once it lets go of them. Storage copies of groups are not built.
"""
from __future__ import annotations

from typing import NamedTuple

from fastkv.cache.groups import GroupedCache
from fastkv.cache.plan import CopyKind, CopyPlan


class GroupCopy(NamedTuple):
    group: int  # index into GroupedCache.groups
    plan: CopyPlan


def _plan(cache: GroupedCache, kind: CopyKind, src: list[int], dst: list[int], group: int) -> CopyPlan:
    plan = CopyPlan(cache.next_plan, kind, src, dst, group=group)
    cache.next_plan += 1
    return plan


def offload(cache: GroupedCache, request_id: object) -> list[GroupCopy] | None:
    """SWAP_OUT plans of the blocks the request holds, one per group."""
    req = cache.record(request_id, "running")
    if any(gp.host.num_available < len(gp.held[request_id].table) for gp in cache.groups):
        return None
    copies = []
    for gp in cache.groups:
        table = gp.held[request_id].table
        order = sorted(table)
        host = gp.host.take_many(len(order))
        gp.offloaded[request_id] = dict(zip(order, host, strict=True))
        copies.append(GroupCopy(gp.index, _plan(cache, CopyKind.SWAP_OUT, [table[i] for i in order], host,
                                                gp.index)))
    req.state = "offloading"
    return copies


def offloaded(cache: GroupedCache, request_id: object, ok: bool) -> None:
    """The offload's copies are done: its device blocks and reservations go (keyed ones CACHED).
    A failed copy leaves the request running on its device blocks."""
    req = cache.record(request_id, "offloading")
    for gp in cache.groups:
        host = gp.offloaded.pop(request_id) if not ok else None
        if host is not None:
            gp.host.release_many(list(host.values()), keep=False)
            continue
        h = gp.held[request_id]
        gp.reserve(h, 0)
        gp.pool.release_many([h.table[i] for i in sorted(h.table, reverse=True)])
        h.table = {}
    req.state = "offloaded" if ok else "running"


def restore(cache: GroupedCache, request_id: object) -> list[GroupCopy] | None:
    """SWAP_IN plans bringing the request's host blocks back into fresh device blocks, with its
    reservations as at admission."""
    req = cache.record(request_id, "offloaded")
    needs = []
    for gp in cache.groups:
        n = len(gp.offloaded[request_id])
        need = cache.reservation(gp, n, req.num_tokens, req.chunk)
        if gp.available < n + need:
            return None
        needs.append(need)
    copies = []
    for gp, need in zip(cache.groups, needs, strict=True):
        host = gp.offloaded[request_id]
        order = sorted(host)
        h = gp.held[request_id]
        h.table = dict(zip(order, gp.pool.take_many(len(order)), strict=True))
        gp.reserve(h, need)
        copies.append(GroupCopy(gp.index, _plan(cache, CopyKind.SWAP_IN, [host[i] for i in order],
                                                [h.table[i] for i in order], gp.index)))
    req.state = "restoring"
    return copies


def restored(cache: GroupedCache, request_id: object, ok: bool) -> None:
    """The restore's copies are done: the host blocks go. A failed one loses the request's KV:
    it is freed (the caller recomputes it)."""
    req = cache.record(request_id, "restoring")
    for gp in cache.groups:
        host = gp.offloaded.pop(request_id)
        gp.host.release_many(list(host.values()), keep=False)
    req.state = "running"
    if not ok:
        cache.free(request_id, cache=False)


def unrestore(cache: GroupedCache, request_id: object) -> None:
    """A restore preempted while its copies flew, once they are done: OFFLOADED again on the host
    blocks it kept; the device blocks the copies wrote go (FREE: the request's own, unkeyed)."""
    req = cache.record(request_id, "restoring")
    for gp in cache.groups:
        h = gp.held[request_id]
        gp.reserve(h, 0)
        gp.pool.release_many([h.table[i] for i in sorted(h.table, reverse=True)], keep=False)
        h.table = {}
    req.state = "offloaded"

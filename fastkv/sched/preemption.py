"""Preemption: take a request's device blocks back, by recompute or by copy.

Recompute frees the blocks at once (the full computed ones stay cached, so re-admission
reuses whatever survives). Offload and storage copy every computed block to the host and
release the device blocks only when the copy completes: until then the request is
OFFLOADING and the blocks are IN_FLIGHT; nobody waits, a request that needs those blocks
stalls a bounded number of steps (``copy_patience_steps``; an empty step counts only when no copy
completed since the previous one, since an engine idling on its inbox calls ``step()`` on every
completion) and then preempts by recompute. A request whose restore is still loading goes back
to OFFLOADED with no copy: its host copies still hold its KV.
"""
from __future__ import annotations

from collections.abc import Container
from itertools import chain
from typing import TYPE_CHECKING

from fastkv.config import cdiv
from fastkv.sched.queues import pick_victim, victim_key
from fastkv.sched.request import PreemptionMode, Request, RequestState

if TYPE_CHECKING:
    from fastkv.cache.plan import Growth
    from fastkv.sched.batch import StepBatch
    from fastkv.sched.parts import SchedulerParts
    from fastkv.sched.table import RequestTable

S = RequestState
M = PreemptionMode


def choose_mode(p: SchedulerParts, req: Request, force_recompute: bool) -> PreemptionMode:
    cache = p.cache
    if req.state is S.LOADING and cache.is_restoring(req.request_id):
        return M.OFFLOAD  # its host copies still hold all its KV: OFFLOADED again, nothing recomputed
    mode = req.preemption if req.preemption is not None else p.config.preemption
    policy = req.cache_policy
    if policy is not None:  # a copy it may not write or read back: storage falls back to offload, then recompute
        if mode is M.STORAGE and not policy.may_store():
            mode = M.OFFLOAD
        if not policy.may_offload():
            mode = M.RECOMPUTE
    if (mode is M.RECOMPUTE or force_recompute or req.state is not S.RUNNING or req.num_computed_tokens == 0
            or not cache.has_host_tier):
        return M.RECOMPUTE  # a LOADING request has nothing exact to copy yet
    if mode is M.AUTO:  # compare what each would really do: both reuse the host copies it has, if they last
        work = cache.preemption_work(req.request_id)
        offload = p.cost.prefer_offload(work.recompute_tokens, work.copy_blocks, work.unheld_tokens,
                                        cache.host_occupancy)
        return M.OFFLOAD if offload else M.RECOMPUTE
    return mode


def preempt(p: SchedulerParts, batch: StepBatch, req: Request, updating: bool, force_recompute: bool = False) -> None:
    """Preempt a RUNNING or LOADING request; the caller has decided it must go. ``updating``:
    a weight update is under way (offloaded KV is of the old weights)."""
    assert not req.remote_pending, f"request {req.request_id}: remote KV is being written into its blocks"
    table, stats = p.table, p.table.stats
    mode = choose_mode(p, req, force_recompute)
    batch.unschedule(req)
    table.preempt(req)
    if mode is not M.RECOMPUTE:
        plans = p.cache.offload(req.request_id, to_storage=mode is M.STORAGE)
        if plans is None:
            stats.offload_no_room += 1
        else:
            req.mode_used = mode
            req.num_offloads += 1
            stats.count_preemption(mode)
            p.outbox.emit(plans)
            if p.cache.is_offloaded(req.request_id):  # nothing to copy: the plans are only STOREs
                table.offloaded(req)
                offload_done(p, req, updating)
            else:
                table.start_offloading(req, cdiv(req.num_slotted, p.block_size))
            return
    req.mode_used = M.RECOMPUTE
    stats.count_preemption(M.RECOMPUTE)
    p.cache.free(req.request_id, cache=True)
    table.to_waiting(req, S.PREEMPTED)


def offload_done(p: SchedulerParts, req: Request, updating: bool) -> None:
    """OFFLOADED: wait for restore; in storage mode (or during a weight update) let go of
    the host copies and resume by prefix hits."""
    if req.mode_used is M.STORAGE or updating:
        p.cache.free(req.request_id, cache=not updating)
        p.table.to_waiting(req, S.OFFLOADED)


def relief_blocks(table: RequestTable) -> int:
    """Device blocks that in-flight offloads will release when they complete."""
    return sum(r.relief_blocks for r in table.offloading.values())


def _grown(p: SchedulerParts, req: Request, g: Growth) -> bool:
    req.num_slotted = req.num_tokens
    req.stalled_steps = 0
    p.outbox.emit(g.plans)
    if g.ready:
        return True
    p.table.wait_for_write_back(req)  # a block it took is still being written back
    return False


def grow_reserved(p: SchedulerParts, req: Request) -> bool:
    """Slots for a just-admitted RUNNING request, within what it reserved (never preempts)."""
    if req.num_slotted == req.num_tokens:
        return True
    g = p.cache.append_slots(req.request_id, req.token_span(req.num_slotted, req.num_tokens))
    assert g is not None, f"request {req.request_id}: growth within its reservation failed"
    return _grown(p, req, g)


def ensure_slots(p: SchedulerParts, batch: StepBatch, req: Request, updating: bool,
                 pinned: Container[int] = ()) -> bool:
    """Device slots for every known token of RUNNING ``req``. False: it cannot run this step
    (it stalls, waits for a write-back, or was itself preempted). ``pinned``: requests in the
    step in flight (async scheduling), whose blocks the workers are writing: when one of them
    is the victim, ``req`` waits and ``batch.need_sync`` asks for a step planned after it."""
    if req.num_slotted == req.num_tokens:
        return True
    cache, table, bs, rid, policy = p.cache, p.table, p.block_size, req.request_id, p.config.policy
    while True:
        g = cache.append_slots(rid, req.token_span(req.num_slotted, req.num_tokens))
        if g is not None:
            return _grown(p, req, g)
        short = cdiv(req.num_tokens, bs) - cdiv(req.num_slotted, bs) - cache.num_free_device_blocks
        patient = req.stalled_steps < p.config.copy_patience_steps
        if patient and relief_blocks(table) >= short:
            req.stalled_steps += 1
            table.stats.stalls += 1
            batch.stalled.append(req)
            return False
        candidates = chain(table.running.values(), (r for r in table.loading.values() if not r.remote_pending))
        victim = pick_victim(policy, candidates, exclude=req)
        if victim is not None and victim.request_id in pinned and victim_key(policy, victim) >= victim_key(policy, req):
            batch.need_sync = True
            return False
        if victim is None or victim_key(policy, victim) < victim_key(policy, req):
            preempt(p, batch, req, updating, force_recompute=not patient)
            return False
        preempt(p, batch, victim, updating, force_recompute=not patient)

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

from itertools import chain
from typing import TYPE_CHECKING

from fastkv.config import cdiv
from fastkv.sched.queues import pick_victim, victim_key
from fastkv.sched.request import PreemptionMode, Request, RequestState, move

if TYPE_CHECKING:
    from fastkv.sched.scheduler import Scheduler

S = RequestState
M = PreemptionMode


def choose_mode(s: Scheduler, req: Request, force_recompute: bool) -> PreemptionMode:
    if req.state is S.LOADING and s.cache.is_restoring(req.request_id):
        return M.OFFLOAD  # its host copies still hold all its KV: OFFLOADED again, nothing recomputed
    mode = req.preemption if req.preemption is not None else s.config.preemption
    if (mode is M.RECOMPUTE or force_recompute or req.state is not S.RUNNING or req.num_computed_tokens == 0
            or not s.cache.has_host_tier):
        return M.RECOMPUTE  # a LOADING request has nothing exact to copy yet
    if mode is M.AUTO:
        n = req.num_computed_tokens
        return M.OFFLOAD if s.cost.prefer_offload(n, cdiv(n, s.block_size)) else M.RECOMPUTE
    return mode


def preempt(s: Scheduler, req: Request, force_recompute: bool = False) -> None:
    """Preempt a RUNNING or LOADING request; the caller has decided it must go."""
    assert not req.remote_pending, f"request {req.request_id}: remote KV is being written into its blocks"
    mode = choose_mode(s, req, force_recompute)
    s._unschedule(req)
    if req.state is S.RUNNING:
        del s.running[req.request_id]
    else:
        del s.loading[req.request_id]
    move(req, S.PREEMPTED, S.RUNNING, S.LOADING)
    req.num_preemptions += 1
    s.reset_watermarks()
    if mode is not M.RECOMPUTE:
        plans = s.cache.offload(req.request_id)
        if plans is None:
            s.stats.offload_no_room += 1
        else:
            req.mode_used = mode
            req.num_offloads += 1
            s.stats.count_preemption(mode)
            s._emit(plans)
            if plans:
                req.relief_blocks = cdiv(req.num_slotted, s.block_size)
                move(req, S.OFFLOADING, S.PREEMPTED)
                s.offloading[req.request_id] = req
            else:
                move(req, S.OFFLOADED, S.PREEMPTED)
                s._offload_done(req)
            return
    req.mode_used = M.RECOMPUTE
    s.stats.count_preemption(M.RECOMPUTE)
    s.cache.free(req.request_id, cache=True)
    s._to_waiting(req, S.PREEMPTED)


def relief_blocks(s: Scheduler) -> int:
    """Device blocks that in-flight offloads will release when they complete."""
    return sum(r.relief_blocks for r in s.offloading.values())


def _grown(s: Scheduler, req: Request, g) -> bool:
    req.num_slotted = req.num_tokens
    req.stalled_steps = 0
    s._emit(g.plans)
    if g.ready:
        return True
    del s.running[req.request_id]  # a block it took is still being written back: wait for that copy
    move(req, S.LOADING, S.RUNNING)
    req.load_target = req.num_computed_tokens
    s.loading[req.request_id] = req
    return False


def grow_reserved(s: Scheduler, req: Request) -> bool:
    """Slots for a just-admitted RUNNING request, within what it reserved (never preempts)."""
    if req.num_slotted == req.num_tokens:
        return True
    g = s.cache.append_slots(req.request_id, req._tokens[req.num_slotted:req.num_tokens])
    assert g is not None, f"request {req.request_id}: growth within its reservation failed"
    return _grown(s, req, g)


def ensure_slots(s: Scheduler, req: Request) -> bool:
    """Device slots for every known token of RUNNING ``req``. False: it cannot run this step
    (it stalls, waits for a write-back, or was itself preempted)."""
    if req.num_slotted == req.num_tokens:
        return True
    cache, bs, rid = s.cache, s.block_size, req.request_id
    while True:
        g = cache.append_slots(rid, req._tokens[req.num_slotted:req.num_tokens])
        if g is not None:
            return _grown(s, req, g)
        short = cdiv(req.num_tokens, bs) - cdiv(req.num_slotted, bs) - cache.num_free_device_blocks
        patient = req.stalled_steps < s.config.copy_patience_steps
        if patient and relief_blocks(s) >= short:
            req.stalled_steps += 1
            s.stats.stalls += 1
            s._stalled.append(req)
            return False
        candidates = chain(s.running.values(), (r for r in s.loading.values() if not r.remote_pending))
        victim = pick_victim(s.config.policy, candidates, exclude=req)
        if victim is None or victim_key(s.config.policy, victim) < victim_key(s.config.policy, req):
            preempt(s, req, force_recompute=not patient)
            return False
        preempt(s, victim, force_recompute=not patient)

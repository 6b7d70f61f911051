"""Admission: waiting requests get device blocks, in queue order, while room and budget last.

A request whose prefix is cached on the device runs at once from the end of its hit; one with
host or storage hits (or an offloaded one being restored) waits in LOADING for its copies.
Admission is head-of-line (a request that does not fit stops it, so big requests are not
starved by small ones), except for loads: while LOADING requests already hold
``max_loading_blocks`` device blocks, requests that would load are passed over, and requests
behind them that need no copy are admitted. So copies that are slow, or never complete,
cannot keep the device from admission.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastkv.config import cdiv
from fastkv.sched import preemption
from fastkv.sched.request import RequestState

if TYPE_CHECKING:
    from fastkv.sched.scheduler import Scheduler

S = RequestState


def loading_blocks(s: Scheduler) -> int:
    bs = s.block_size
    return sum(cdiv(r.num_slotted, bs) for r in s.loading.values())


def admit(s: Scheduler) -> None:
    cfg, cache, bs = s.config, s.cache, s.block_size
    loading = loading_blocks(s)
    for req in s.waiting:
        if s._budget <= 0 or len(s.running) + len(s.loading) >= cfg.max_num_seqs:
            return
        restoring = req.state is S.OFFLOADED
        n_blocks = cdiv(req.num_slotted if restoring else req.num_tokens, bs)
        device_hit = 0
        if loading and loading + n_blocks > s.max_loading_blocks or cfg.watermark_admission:
            # Only now is a read-only prefix match worth its hashing.
            loads = restoring
            if not restoring:
                m = cache.match(req.token_ids, req.extra)
                loads = bool(m.host_blocks or m.storage_keys)
                device_hit = len(m.device_blocks)
            if loads and loading and loading + n_blocks > s.max_loading_blocks:
                s.stats.deferred_loads += 1
                continue
            room = cache.num_free_device_blocks - s.growth_reservation()
            if cfg.watermark_admission and room < n_blocks - device_hit:
                return
        if restoring:  # reserve a slot for a token sampled just before it was preempted
            a = cache.restore(req.request_id, reserve_tokens=req.num_tokens - req.num_slotted)
        else:
            a = cache.allocate(req.request_id, req.token_ids, req.extra)
        if a is None:
            return
        s.waiting.remove(req)
        s._emit(a.plans)
        s._admitted(req)
        if restoring:
            req.num_restores += 1
            s.stats.restored += 1
            target = req.num_computed_tokens
        else:
            req.num_slotted = req.num_tokens
            target = a.num_cached_tokens + a.num_pending_tokens
        if a.ready:
            computed = cache.num_computed_tokens(req.request_id) if restoring else a.num_cached_tokens
            s._start_running(req, computed, S.OFFLOADED if restoring else S.WAITING)
            if preemption.grow_reserved(s, req):
                s._schedule(req)
        else:
            s._start_loading(req, target, S.OFFLOADED if restoring else S.WAITING)
            loading += n_blocks

"""Admission: waiting requests get device blocks, in queue order, while room and budget last.

A request whose prefix is cached on the device runs at once from the end of its hit; one with
host or storage hits (or an offloaded one being restored) waits in LOADING for its copies.
Which host and storage hits are worth their copies is the hit policy's call (``judge_hits``).
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
from fastkv.sched.reservation import must_wait

if TYPE_CHECKING:
    from fastkv.sched.batch import StepBatch
    from fastkv.sched.parts import SchedulerParts

S = RequestState


def loading_blocks(p: SchedulerParts) -> int:
    bs = p.block_size
    return sum(cdiv(r.num_slotted, bs) for r in p.table.loading.values())


def judge_hits(p: SchedulerParts, first: int, n_host: int, n_storage: int, count: bool = True) -> tuple[int, int]:
    """The host and storage hits worth loading (``fastkv.sched.hits``), behind the copies on each
    link. ``count``: False for a look ahead (a request that will not load is not held back as a load)."""
    return p.hits.cut(first, n_host, n_storage, p.cache.queued_blocks(), count)


def admit(p: SchedulerParts, batch: StepBatch) -> None:
    cfg, cache, table, bs = p.config, p.cache, p.table, p.block_size
    loading = loading_blocks(p)
    for req in table.waiting:
        if batch.budget <= 0 or table.num_holding >= cfg.max_num_seqs:
            return
        restoring = req.state is S.OFFLOADED
        n_blocks = cdiv(req.num_slotted if restoring else req.num_tokens, bs)
        holds_back = cfg.watermark_admission or cfg.growth_admission
        if loading and loading + n_blocks > p.max_loading_blocks or holds_back:
            # Only now is a read-only prefix match worth its hashing.
            loads, m = restoring, None
            if not restoring:
                m = cache.match(req.token_ids, req.extra, req.cache_policy)
                loads = any(judge_hits(p, len(m.device_blocks), len(m.host_blocks), len(m.storage_keys), count=False))
            if loads and loading and loading + n_blocks > p.max_loading_blocks:
                table.stats.deferred_loads += 1
                continue
            if holds_back and must_wait(p, req, n_blocks, m):
                return
        if restoring:  # reserve a slot for a token sampled just before it was preempted
            a = cache.restore(req.request_id, reserve_tokens=req.num_tokens - req.num_slotted)
        else:
            a = cache.allocate(req.request_id, req.token_ids, req.extra, policy=req.cache_policy,
                               hits=lambda *n: judge_hits(p, *n))
        if a is None:
            return
        p.outbox.emit(a.plans)
        table.admit(req)
        if restoring:
            req.num_restores += 1
            table.stats.restored += 1
            target = req.num_computed_tokens
        else:
            req.num_slotted = req.num_tokens
            target = a.num_cached_tokens + a.num_pending_tokens
        if a.ready:
            computed = cache.num_computed_tokens(req.request_id) if restoring else a.num_cached_tokens
            table.start_running(req, computed, S.OFFLOADED if restoring else S.WAITING)
            if preemption.grow_reserved(p, req):
                batch.schedule(req)
        else:
            table.start_loading(req, target, S.OFFLOADED if restoring else S.WAITING)
            loading += n_blocks

"""Disaggregated serving, decode side: reserve blocks for a request prefilled elsewhere.

The prefill instance asks before it sends KV. The decode instance says yes only if its free
device blocks, minus a reservation for the growth of the requests it is already running,
cover the newcomer; otherwise it refuses with a reason, and the prefill instance keeps the
request (or asks another decode instance) instead of both overcommitting and preempting.

The growth reservation is every block the running requests can still need (to
``max_new_tokens`` or ``max_model_len``): a request taken in then never costs a running one a
preemption; an early stop gives its share back. With ``overcommit_growth`` it is FastDeploy's
decaying watermark instead, kept per running request: a request starts at
``reserve_init_blocks``, each step multiplies it by ``reserve_decay`` down to
``reserve_min_blocks`` (a batch that has been decoding a while has shown its growth rate),
capped by the blocks the request can still need, and any preemption resets all of them; more
requests run at once, and a running one is preempted when its growth outruns the estimate.

Accepted: the request is allocated (device prefix hits reused; host or storage hits are
loaded locally) and waits in LOADING. The remote KV fills positions
``[first_position, last_position)``; the last known token is computed by its first decode
step. Its blocks may be written once ``Reservation.writable``, or once the request id shows
up in ``SchedulerOutput.kv_writable`` (a fresh block may still be read by the write-back of
the cached block it replaced; until then, and until local prefix copies are done, the remote
side waits). ``on_prefilled(request_id, ok)`` reports the arrival; a failed transfer falls
back to recomputing the prompt here. Until then its blocks are written from outside the
cache's knowledge, so the request is not a preemption victim, and abort takes effect on
arrival.
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from fastkv.config import cdiv
from fastkv.sched.request import Request, RequestState

if TYPE_CHECKING:
    from fastkv.cache.manager import MatchResult
    from fastkv.sched.config import SchedulerConfig
    from fastkv.sched.parts import SchedulerParts
    from fastkv.sched.table import RequestTable

S = RequestState


class RefusalReason(IntEnum):
    NO_ROOM = 1  # free blocks minus the growth reservation do not cover it
    WEIGHT_UPDATE = 2  # admission is paused
    TOO_MANY_SEQS = 3  # max_num_seqs requests already hold blocks


class Reservation(NamedTuple):
    request_id: int
    block_table: np.ndarray  # int32 device block ids for every known token
    first_position: int  # the remote KV fills [first_position, last_position); below is here already
    last_position: int  # num_tokens - 1
    writable: bool  # False: a block is still being written back; wait for SchedulerOutput.kv_writable


class Refusal(NamedTuple):
    request_id: int
    reason: RefusalReason
    needed_blocks: int  # its KV and its own growth (module docstring), less its device prefix hits
    free_blocks: int
    reserved_blocks: int  # for the growth of running requests

    @property
    def detail(self) -> str:
        return (f"request {self.request_id} refused ({self.reason.name}): needs {self.needed_blocks} blocks, "
                f"{self.free_blocks} free, {self.reserved_blocks} reserved for running requests")


def growth_reservation(p: SchedulerParts, watermark: bool) -> int:
    """Device blocks held back for the growth of requests that hold blocks: all they can still
    need, or (``watermark``) their watermarks of that (module docstring)."""
    table = p.table
    return sum(_growth(p, r, r.watermark if watermark else None)
               for group in (table.running, table.loading) for r in group.values())


def _growth(p: SchedulerParts, r: Request, watermark: float | None) -> int:
    """Blocks ``r`` may still take beyond its slots: all it can need, or at most ``watermark``."""
    bs = p.block_size
    final = min(r.num_prompt_tokens + r.max_new_tokens, p.max_model_len)
    still = max(0, cdiv(final, bs) - cdiv(max(r.num_slotted, r.num_tokens), bs))
    return still if watermark is None else min(int(np.ceil(watermark)), still)


def must_wait(p: SchedulerParts, req: Request, n_blocks: int, match: MatchResult | None) -> bool:
    """Local admission holding growth back: whether ``req`` (``n_blocks``, its prefix ``match``)
    waits. ``growth_admission``: the rule of ``reserve`` (a decode engine never preempts a running
    request for a newcomer of its own either); else ``watermark_admission``'s watermarks."""
    cache = p.cache
    if p.config.growth_admission:
        hits = cache.num_held_hits(match) if match is not None else 0
        need = n_blocks - hits + _growth(p, req, None)
        return cache.num_free_device_blocks - growth_reservation(p, False) < need
    hits = len(match.device_blocks) if match is not None else 0
    return cache.num_free_device_blocks - growth_reservation(p, True) < n_blocks - hits


def decay_watermarks(table: RequestTable, cfg: SchedulerConfig) -> None:
    for r in table.running.values():
        r.watermark = max(cfg.reserve_min_blocks, r.watermark * cfg.reserve_decay)


def _refuse(p: SchedulerParts, refusal: Refusal) -> Refusal:
    p.table.stats.refused_prefilled += 1
    return refusal


def reserve(p: SchedulerParts, req: Request, updating: bool, tail_key: bytes | None = None) -> Reservation | Refusal:
    """Admit ``req`` (new, validated) with its blocks, or refuse it and touch nothing.
    ``tail_key``: the remote KV is in storage (``CacheManager.allocate``)."""
    cache, table, rid = p.cache, p.table, req.request_id
    need = cdiv(req.num_tokens, p.block_size)
    free = cache.num_free_device_blocks
    if updating:
        return _refuse(p, Refusal(rid, RefusalReason.WEIGHT_UPDATE, need, free, 0))
    if table.num_holding >= p.config.max_num_seqs:
        return _refuse(p, Refusal(rid, RefusalReason.TOO_MANY_SEQS, need, free, 0))
    need -= cache.num_held_hits(cache.match(req.token_ids, req.extra, req.cache_policy))
    overcommit = p.config.overcommit_growth
    need += _growth(p, req, p.config.reserve_init_blocks if overcommit else None)  # reserved from the start
    held = growth_reservation(p, overcommit)
    if free - held < need:
        return _refuse(p, Refusal(rid, RefusalReason.NO_ROOM, need, free, held))
    a = cache.allocate(rid, req.token_ids, req.extra, tail_key=tail_key, policy=req.cache_policy)
    if a is None:
        return _refuse(p, Refusal(rid, RefusalReason.NO_ROOM, need, free, held))
    p.outbox.emit(a.plans)
    table.admit_prefilled(req)
    req.prefilled = True
    req.remote_pending = True
    req.num_slotted = req.num_tokens
    req.remote_start = a.num_cached_tokens + a.num_pending_tokens
    req.local_computed = a.num_cached_tokens if a.ready else -1
    table.start_loading(req, req.remote_start, S.WAITING)
    table.stats.reserved_prefilled += 1
    return Reservation(rid, np.asarray(a.block_table, np.int32), req.remote_start, req.num_tokens - 1, a.ready)

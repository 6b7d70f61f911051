"""Weight update (RL): pause admission, drain or preempt, clear the caches, restore.

KV computed under the old weights must never be served under the new ones. The cache manager
drops its index and switches namespace; the scheduler gets there without waiting on anything:
``begin`` pauses admission, each ``step()`` moves the update along (offloaded requests let go of
their host copies and will recompute; without ``drain`` running ones are preempted too), and
once no request holds blocks and no copy is in flight a CLEAR plan goes out. Its completion
makes the state READY: the engine loads the new weights and calls ``finish_weight_update``.
"""
from __future__ import annotations

from enum import IntEnum
from typing import TYPE_CHECKING

from fastkv.sched import preemption
from fastkv.sched.request import RequestState

if TYPE_CHECKING:
    from fastkv.sched.scheduler import Scheduler

S = RequestState


class WeightUpdate(IntEnum):
    NONE = 0
    DRAINING = 1  # admission paused; requests leave the device, copies finish
    CLEARING = 2  # the CLEAR plan is out
    READY = 3  # caches cleared: load the new weights, then finish_weight_update


def progress(s: Scheduler, drain: bool) -> None:
    """One step's worth of a DRAINING update; emits CLEAR when nothing is left."""
    for req in list(s.waiting):
        if req.state is S.OFFLOADED:
            s.waiting.remove(req)
            s.cache.free(req.request_id, cache=False)
            s._to_waiting(req, S.OFFLOADED)
    if not drain:
        for req in [*s.running.values(), *(r for r in s.loading.values() if not r.remote_pending)]:
            preemption.preempt(s, req, force_recompute=True)
        for req in list(s.offloading.values()):
            del s.offloading[req.request_id]
            req.relief_blocks = 0
            s.cache.free(req.request_id, cache=False)
            s._to_waiting(req, S.OFFLOADING)
    if s.running or s.loading or s.offloading or s._outbox or s._dispatched or s.cache.copies_in_flight():
        return
    s._emit([s.cache.begin_weight_update()])
    s.weight_update_state = WeightUpdate.CLEARING

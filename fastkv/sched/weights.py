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
    from fastkv.sched.batch import StepBatch
    from fastkv.sched.parts import SchedulerParts

S = RequestState


class WeightUpdate(IntEnum):
    NONE = 0
    DRAINING = 1  # admission paused; requests leave the device, copies finish
    CLEARING = 2  # the CLEAR plan is out
    READY = 3  # caches cleared: load the new weights, then finish_weight_update


def progress(p: SchedulerParts, batch: StepBatch, drain: bool) -> bool:
    """One step's worth of a DRAINING update. True: nothing was left, the CLEAR plan is out."""
    cache, table = p.cache, p.table
    for req in list(table.waiting):
        if req.state is S.OFFLOADED:
            cache.free(req.request_id, cache=False)
            table.to_waiting(req, S.OFFLOADED)
    if not drain:
        for req in [*table.running.values(), *(r for r in table.loading.values() if not r.remote_pending)]:
            preemption.preempt(p, batch, req, updating=True, force_recompute=True)
        for req in list(table.offloading.values()):
            cache.free(req.request_id, cache=False)
            table.to_waiting(req, S.OFFLOADING)
    # an export still holding device blocks would copy them after the CLEAR: old KV, or none
    if (table.running or table.loading or table.offloading or p.outbox or cache.copies_in_flight()
            or cache.num_export_holds):
        return False
    p.outbox.emit([cache.begin_weight_update()])
    return True

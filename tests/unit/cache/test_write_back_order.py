"""Regression: a device block evicted while its key is already on its way to the host.

``take_device`` planned a second write-back for such a key; the copy book then tracked only
the newer plan, and completing it before the older one dropped the key from the in-flight
set while the older plan was still open ("in-flight keys do not match the open
write-back/through plans"). Found by the issue-12 refactor's replay (RECOMPUTE, seed 2) and by
the manager state machine with copies completed out of order.
"""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from fastkv.sched.output import StepOutput


@pytest.mark.parametrize("mode", list(PreemptionMode))
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_copies_completed_out_of_order_keep_the_cache_consistent(mode, seed):
    rng = np.random.default_rng(seed)
    cache = CacheManager(CacheConfig(num_device_blocks=48, num_host_blocks=64, block_size=16))
    sched = Scheduler(cache, SchedulerConfig(preemption=mode, max_num_batched_tokens=128, block_bytes=4096))
    for i in range(120):
        prompt = rng.integers(0, 50, int(rng.integers(8, 150)))
        sched.add_request(Request(i, prompt, max_new_tokens=int(rng.integers(4, 40))))
    pending = []
    while sched.has_work():
        out = sched.step()
        sched.check_integrity()
        pending += out.copies
        while len(pending) > 3:  # up to four copies in flight, completed in a random order
            sched.on_copy_complete(pending.pop(int(rng.integers(len(pending)))).plan_id, True)
            sched.check_integrity()
        if not out.plan.seqs and pending:
            sched.on_copy_complete(pending.pop(0).plan_id, True)
            sched.check_integrity()
        if out.plan.seqs:
            sched.on_step_output(StepOutput(out.plan.step_id, {q.request_id: 7 for q in out.plan.seqs if q.sample},
                                            0.001))
            sched.check_integrity()
    assert not sched.requests and cache.request_ids() == [] and not cache.copies_in_flight()

"""What preempting a request would cost each way (``CacheManager.preemption_work``), beside
write-through host copies, and the host tier's occupancy that prices the copies a recompute
does not hold (auto preemption, ``fastkv.sched.cost``)."""
from __future__ import annotations

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import PreemptionWork
from fastkv.cache.write_policy import WritePolicy

BS = 2


def manager(host: int) -> CacheManager:
    return CacheManager(CacheConfig(num_device_blocks=8, num_host_blocks=host, block_size=BS,
                                    policy=WritePolicy.WRITE_THROUGH))


def test_a_recompute_counts_on_the_leading_host_copies_it_does_not_hold():
    m = manager(host=8)
    assert m.host_occupancy == 0.0
    m.allocate("a", [1, 2, 3, 4, 5])
    copies = m.mark_computed("a", 5)  # two full blocks go to the host, the partial one cannot
    assert m.preemption_work("a") == PreemptionWork(copy_blocks=3, recompute_tokens=1, unheld_tokens=4)
    for c in copies:
        m.complete(c, True)
    assert m.preemption_work("a") == PreemptionWork(copy_blocks=1, recompute_tokens=1, unheld_tokens=4)
    assert m.host_occupancy == 2 / 8  # the landed copies are cached: not free
    m.check_integrity()


def test_without_host_copies_nothing_is_unheld():
    m = CacheManager(CacheConfig(num_device_blocks=8, num_host_blocks=8, block_size=BS,
                                 policy=WritePolicy.WRITE_BACK))
    m.allocate("a", [1, 2, 3, 4, 5])
    assert m.mark_computed("a", 5) == []
    assert m.preemption_work("a") == PreemptionWork(copy_blocks=3, recompute_tokens=5, unheld_tokens=0)
    assert manager(host=0).host_occupancy == 0.0

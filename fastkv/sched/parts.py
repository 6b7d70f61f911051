"""What the scheduler's role modules (admission, preemption, reservation, weights, integrity)
work on: the scheduler's parts, each the one owner of its state, and the limits the scheduler
derived from its config. They take this, never the Scheduler."""
from __future__ import annotations

from dataclasses import dataclass

from fastkv.cache.manager import CacheManager
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.cost import CostModel
from fastkv.sched.hits import HitPolicy
from fastkv.sched.outbox import CopyOutbox
from fastkv.sched.table import RequestTable


@dataclass(frozen=True, slots=True)
class SchedulerParts:
    cache: CacheManager  # through its public methods only
    config: SchedulerConfig
    cost: CostModel
    table: RequestTable  # the requests and their states
    outbox: CopyOutbox  # copy plans queued and in flight
    max_model_len: int
    max_loading_blocks: int
    hits: HitPolicy  # which host and storage hits admission loads

    @property
    def block_size(self) -> int:
        return self.cache.block_size

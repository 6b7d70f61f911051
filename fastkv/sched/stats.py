"""Counters of the scheduler: what it preempted, how, and what that cost."""
from __future__ import annotations

from dataclasses import dataclass

from fastkv.sched.request import PreemptionMode


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0  # non-empty step plans
    prefill_tokens: int = 0  # tokens computed in chunks of more than one token
    decode_tokens: int = 0
    admitted: int = 0  # admissions, restores and re-admissions included
    finished: int = 0
    aborted: int = 0
    preempt_recompute: int = 0
    preempt_offload: int = 0
    preempt_storage: int = 0
    offload_no_room: int = 0  # offload wanted, the host tier was full: recomputed instead
    offload_failed: int = 0  # an offload copy failed: recomputed instead
    restored: int = 0  # offloaded requests that came back
    load_shortfalls: int = 0  # a load or restore brought fewer tokens than planned (failed copy)
    recomputed_tokens: int = 0  # tokens computed again at positions computed before
    deferred_loads: int = 0  # admissions put off by max_loading_blocks
    stalls: int = 0  # request-steps spent waiting for in-flight offloads to free blocks
    reserved_prefilled: int = 0
    refused_prefilled: int = 0
    copies: int = 0  # plans handed to the transfer layer
    copies_failed: int = 0

    def count_preemption(self, mode: PreemptionMode) -> None:
        if mode is PreemptionMode.OFFLOAD:
            self.preempt_offload += 1
        elif mode is PreemptionMode.STORAGE:
            self.preempt_storage += 1
        else:
            self.preempt_recompute += 1

    @property
    def preemptions(self) -> int:
        return self.preempt_recompute + self.preempt_offload + self.preempt_storage

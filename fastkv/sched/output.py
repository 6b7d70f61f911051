"""What the scheduler puts out: the unit of work the engine sends to every worker rank, what
rank 0 sends back, and one step's ``SchedulerOutput``.

A ``StepPlan`` is the same message for every rank: the engine decides which requests run,
which tokens they compute and which device blocks hold their KV; each rank computes its
shard. Block tables are device block ids; position ``p`` of a sequence lives in block
``block_table[p // block_size]``, slot ``p % block_size``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fastkv.cache.plan import CopyPlan
from fastkv.sched.request import Request


@dataclass(slots=True)
class SeqWork:
    """One request's work in one step."""

    request_id: int
    token_ids: np.ndarray  # int32, the new tokens computed this step (a prefill chunk, or 1 decode token)
    start_pos: int  # tokens whose KV is already in the cache (positions 0..start_pos-1)
    block_table: np.ndarray  # int32 device block ids covering positions 0..start_pos+len(token_ids)-1
    sample: bool  # True when this step ends the prompt (last prefill chunk) or is a decode step

    def __post_init__(self) -> None:
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype=np.int32).reshape(-1)
        self.block_table = np.ascontiguousarray(self.block_table, dtype=np.int32).reshape(-1)

    @property
    def end_pos(self) -> int:
        """One past the last position computed this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    seqs: list[SeqWork]


class StepOutput(NamedTuple):
    step_id: int
    sampled: dict[int, int]  # request_id -> next token (only for seqs with sample=True)
    seconds: float


class SchedulerOutput(NamedTuple):
    plan: StepPlan  # for every worker rank; may have no seqs (then send nothing)
    copies: list[CopyPlan]  # dispatch to the transfer layer now; report each with on_copy_complete
    finished: list[Request]  # finished (or aborted) since the previous step()
    kv_writable: list[int]  # prefilled requests whose reserved blocks may now receive their remote KV


def validate_plan(plan: StepPlan, block_size: int, num_device_blocks: int) -> None:
    """Raise ValueError naming the request whose work cannot be executed as given."""
    if not isinstance(plan, StepPlan):
        raise TypeError(f"step() takes a StepPlan, got {type(plan).__name__}")
    seen: set[int] = set()
    written = []
    for seq in plan.seqs:
        rid = seq.request_id
        if rid in seen:
            raise ValueError(f"step {plan.step_id}: request {rid} appears twice")
        seen.add(rid)
        if len(seq.token_ids) == 0:
            raise ValueError(f"step {plan.step_id}: request {rid} has no new tokens")
        if seq.start_pos < 0:
            raise ValueError(f"step {plan.step_id}: request {rid} has negative start_pos {seq.start_pos}")
        if np.any(seq.token_ids < 0):
            raise ValueError(f"step {plan.step_id}: request {rid} has negative token ids")
        need = -(-seq.end_pos // block_size)
        if len(seq.block_table) < need:
            raise ValueError(
                f"step {plan.step_id}: request {rid} needs {need} blocks for {seq.end_pos} positions, "
                f"block table has {len(seq.block_table)}"
            )
        used = seq.block_table[:need]
        if np.any(used < 0) or np.any(used >= num_device_blocks):
            raise ValueError(
                f"step {plan.step_id}: request {rid} block table {used.tolist()} has ids outside "
                f"[0, {num_device_blocks})"
            )
        if len(np.unique(used)) != need:
            raise ValueError(f"step {plan.step_id}: request {rid} block table {used.tolist()} repeats a block")
        written.append(slot_ids(seq, block_size))
    if len(written) > 1:
        slots = np.concatenate(written)
        if len(np.unique(slots)) != len(slots):
            raise ValueError(f"step {plan.step_id}: two requests write the same KV slot")


def slot_ids(seq: SeqWork, block_size: int) -> np.ndarray:
    """Flat slot index (block * block_size + offset) of every new token of ``seq``."""
    pos = np.arange(seq.start_pos, seq.end_pos, dtype=np.int64)
    return seq.block_table[pos // block_size].astype(np.int64) * block_size + pos % block_size

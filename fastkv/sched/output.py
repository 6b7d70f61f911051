"""What the scheduler puts out: the unit of work the engine sends to every worker rank, what
rank 0 sends back, and one step's ``SchedulerOutput``.

A ``StepPlan`` is the same message for every rank: the engine decides which requests run,
which tokens they compute and which device blocks hold their KV; each rank computes its
shard. Block tables are device block ids; position ``p`` of a sequence lives in block
``block_table[p // block_size]``, slot ``p % block_size``. A sliding-window hybrid layout's
tables are [groups, blocks], one row per KV cache group (``KVLayout.groups``): layer l reads row
``layout.group_of(l)``, and -1 marks a block that group does not hold (slid out of its window).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from fastkv.cache.plan import CopyPlan
from fastkv.config import KVGroup
from fastkv.sched.request import Request

PLACEHOLDER = -1  # an input token the step before (in flight) samples: the worker fills it in


@dataclass(slots=True)
class SeqWork:
    """One request's work in one step."""

    request_id: int
    token_ids: np.ndarray  # int32, the new tokens computed this step (a prefill chunk, or 1 decode token)
    start_pos: int  # tokens whose KV is already in the cache (positions 0..start_pos-1)
    # int32 device block ids covering positions 0..start_pos+len(token_ids)-1 (a hybrid: one row per group)
    block_table: np.ndarray
    sample: bool  # True when this step ends the prompt (last prefill chunk) or is a decode step

    def __post_init__(self) -> None:
        self.token_ids = np.ascontiguousarray(self.token_ids, dtype=np.int32).reshape(-1)
        table = np.ascontiguousarray(self.block_table, dtype=np.int32)
        self.block_table = table if table.ndim == 2 else table.reshape(-1)

    @property
    def end_pos(self) -> int:
        """One past the last position computed this step."""
        return self.start_pos + len(self.token_ids)


@dataclass(slots=True)
class StepPlan:
    step_id: int
    seqs: list[SeqWork]
    # the worker side's: the last layered SWAP_IN acked before this step (``PlanMsg.wait_landed``)
    wait_landed: int = 0


class StepOutput(NamedTuple):
    step_id: int
    sampled: dict[int, int]  # request_id -> next token (only for seqs with sample=True)
    seconds: float


class SchedulerOutput(NamedTuple):
    plan: StepPlan  # for every worker rank; may have no seqs (then send nothing)
    copies: list[CopyPlan]  # dispatch to the transfer layer now; report each with on_copy_complete
    finished: list[Request]  # finished (or aborted) since the previous step()
    kv_writable: list[int]  # prefilled requests whose reserved blocks may now receive their remote KV


def validate_plan(plan: StepPlan, block_size: int, num_device_blocks: int,
                  groups: Sequence[KVGroup] = (), group_blocks: Sequence[int] = ()) -> None:
    """Raise ValueError naming the request whose work cannot be executed as given (the first,
    in plan order, with the first fault ``_validate_each`` finds in it). ``groups`` (a hybrid
    layout's, more than one) and ``group_blocks`` (each group's device blocks): the plan's tables
    are per group (``validate_grouped``).

    Runners call this every step on every rank, so the whole plan is checked in a few numpy
    calls (per sequence, numpy's fixed costs add up to milliseconds for a full batch); any fault
    found sends the plan through ``_validate_each``, the per-sequence definition, for the
    exact message."""
    if not isinstance(plan, StepPlan):
        raise TypeError(f"step() takes a StepPlan, got {type(plan).__name__}")
    if len(groups) > 1:
        validate_grouped(plan, block_size, groups, group_blocks or [num_device_blocks] * len(groups))
        return
    if plan.seqs and _faulty(plan.seqs, block_size, num_device_blocks):
        _validate_each(plan, block_size, num_device_blocks)
        raise AssertionError(f"step {plan.step_id}: validate_plan found a fault _validate_each does not")


def _faulty(seqs: list[SeqWork], block_size: int, num_device_blocks: int) -> bool:
    """Whether any check of ``_validate_each`` fails, for the whole plan at once."""
    needs, lens = [], []
    for seq in seqs:  # the scalar checks
        n = len(seq.token_ids)
        need = -(-(seq.start_pos + n) // block_size)
        if n == 0 or seq.start_pos < 0 or len(seq.block_table) < need:
            return True
        needs.append(need)
        lens.append(n)
    if len({s.request_id for s in seqs}) != len(seqs):
        return True
    toks = np.concatenate([s.token_ids for s in seqs])
    used = np.concatenate([s.block_table[:need] for s, need in zip(seqs, needs, strict=True)]).astype(np.int64)
    if toks.min() < 0 or used.min() < 0 or used.max() >= num_device_blocks:
        return True
    # a block twice in one table: a (sequence, block) pair repeats
    pairs = np.sort(np.repeat(np.arange(len(seqs), dtype=np.int64), needs) * num_device_blocks + used)
    if np.any(pairs[1:] == pairs[:-1]):
        return True
    if len(seqs) == 1:
        return False
    # two sequences write one slot
    lens_a, needs_a = np.array(lens, np.int64), np.array(needs, np.int64)
    pos = np.repeat(np.array([s.start_pos for s in seqs], np.int64) - (np.cumsum(lens_a) - lens_a), lens_a)
    pos += np.arange(len(toks))
    slots = used[np.repeat(np.cumsum(needs_a) - needs_a, lens_a) + pos // block_size] * block_size + pos % block_size
    slots.sort()
    return bool(np.any(slots[1:] == slots[:-1]))


def _validate_each(plan: StepPlan, block_size: int, num_device_blocks: int) -> None:
    """``validate_plan``, sequence by sequence: the definition of its checks and messages."""
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


def validate_grouped(plan: StepPlan, block_size: int, groups: Sequence[KVGroup], group_blocks: Sequence[int]) -> None:
    """``validate_plan`` for per-group tables: per group, every block the step reads or writes
    (a sliding group's from the first its window needs) in range, no block twice in one row, no
    slot written by two requests."""
    seen: set[int] = set()
    written: list[list[np.ndarray]] = [[] for _ in groups]
    for seq in plan.seqs:
        rid, table = seq.request_id, seq.block_table
        if rid in seen:
            raise ValueError(f"step {plan.step_id}: request {rid} appears twice")
        seen.add(rid)
        if len(seq.token_ids) == 0 or seq.start_pos < 0 or np.any(seq.token_ids < 0):
            raise ValueError(f"step {plan.step_id}: request {rid} has no new tokens, a negative start_pos or "
                             f"negative token ids")
        if table.ndim != 2 or table.shape[0] != len(groups):
            raise ValueError(f"step {plan.step_id}: request {rid} has a block table of shape {table.shape}, "
                             f"expected one row per KV cache group ({len(groups)})")
        need = -(-seq.end_pos // block_size)
        if table.shape[1] < need:
            raise ValueError(f"step {plan.step_id}: request {rid} needs {need} blocks for {seq.end_pos} positions, "
                             f"block table has {table.shape[1]}")
        for g, (group, cap) in enumerate(zip(groups, group_blocks, strict=True)):
            row = table[g]
            used = row[group.first_needed(seq.start_pos, block_size):need]
            if np.any(used < 0) or np.any(used >= cap):
                raise ValueError(f"step {plan.step_id}: request {rid} group {g} table {row.tolist()} misses a block "
                                 f"it reads or has ids outside [0, {cap})")
            held = row[row >= 0]
            if len(np.unique(held)) != len(held):
                raise ValueError(f"step {plan.step_id}: request {rid} group {g} table {row.tolist()} repeats a block")
            pos = np.arange(seq.start_pos, seq.end_pos, dtype=np.int64)
            written[g].append(row[pos // block_size].astype(np.int64) * block_size + pos % block_size)
    for g, slots in enumerate(written):
        if len(slots) > 1:
            flat = np.concatenate(slots)
            if len(np.unique(flat)) != len(flat):
                raise ValueError(f"step {plan.step_id}: two requests write the same KV slot of group {g}")


def slot_ids(seq: SeqWork, block_size: int) -> np.ndarray:
    """Flat slot index (block * block_size + offset) of every new token of ``seq``."""
    pos = np.arange(seq.start_pos, seq.end_pos, dtype=np.int64)
    return seq.block_table[pos // block_size].astype(np.int64) * block_size + pos % block_size

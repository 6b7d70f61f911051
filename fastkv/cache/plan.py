"""Copy plans and control tasks: what the cache core and the engine ask the transfer processes to do.

The cache core never copies bytes. It returns a ``CopyPlan``, marks the plan's blocks
IN_FLIGHT, and later receives ``complete(plan, ok)``. The transfer layer carries a plan
to every rank under one task id; each rank copies its own shard of the same block ids.

Tasks that copy nothing have types of their own, with named fields: ``ClearTask`` and
``RestoreTask`` around a weight update, ``LookupTask`` (which keys storage holds). On the
wire every task is (kind, src, dst, keys) (``fastkv.transfer.protocol``); ``task_of`` reads
one back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum
from typing import ClassVar, NamedTuple

import numpy as np


class CopyKind(IntEnum):
    SWAP_OUT = 1  # device -> host: src device ids, dst host ids
    SWAP_IN = 2  # host -> device: src host ids, dst device ids
    STORE = 3  # host -> storage: src host ids, keys
    LOAD = 4  # storage -> host: dst host ids, keys
    CLEAR = 5  # weight update: drop device/host contents (ClearTask)
    RESTORE = 6  # weight update done: re-attach and accept work again (RestoreTask)
    LOOKUP = 7  # which keys storage holds (LookupTask, fastkv.storage.lookup)


COPIES = frozenset((CopyKind.SWAP_OUT, CopyKind.SWAP_IN, CopyKind.STORE, CopyKind.LOAD))
FREE = b"free"  # a CLEAR's only key on the wire: free_memory
GROUP = b"group:"  # a group's SWAP on the wire: its only key, GROUP + the group's index (a swap has no keys)


@dataclass(slots=True)
class CopyPlan:
    plan_id: int
    kind: CopyKind
    src: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    dst: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    keys: tuple[bytes, ...] = ()  # storage keys, one per block, for STORE and LOAD
    # a SWAP of one KV cache group's blocks (ids in its own pools, copied for its layers only);
    # -1: every layer, the all-full layout's one id space (fastkv.cache.group_manager)
    group: int = -1

    def __post_init__(self) -> None:
        if type(self.kind) is not CopyKind:  # CopyKind(member) costs a microsecond or two per task
            self.kind = CopyKind(self.kind)
        if self.kind not in COPIES:
            raise ValueError(f"a CopyPlan copies blocks: {self.kind.name} is a task of its own (task_of)")
        self.src = np.ascontiguousarray(self.src, dtype=np.int32)
        self.dst = np.ascontiguousarray(self.dst, dtype=np.int32)
        if self.kind in (CopyKind.SWAP_OUT, CopyKind.SWAP_IN) and len(self.src) != len(self.dst):
            raise ValueError(f"{self.kind.name} plan needs as many src as dst ids: {len(self.src)} != {len(self.dst)}")
        if self.group != -1 and (self.kind not in (CopyKind.SWAP_OUT, CopyKind.SWAP_IN) or self.group < 0):
            raise ValueError(f"a KV cache group's copy is a SWAP_OUT or SWAP_IN with group >= 0, got "
                             f"{self.kind.name} of group {self.group}")
        if self.kind is CopyKind.STORE and len(self.keys) != len(self.src):
            raise ValueError(f"STORE plan needs one key per src block: {len(self.keys)} != {len(self.src)}")
        if self.kind is CopyKind.LOAD and len(self.keys) != len(self.dst):
            raise ValueError(f"LOAD plan needs one key per dst block: {len(self.keys)} != {len(self.dst)}")

    @property
    def num_blocks(self) -> int:
        return max(len(self.src), len(self.dst))


@dataclass(slots=True)
class ClearTask:
    """A weight update begins: every rank drops its tiers' contents (``free_memory``: and gives
    the host tier's memory back to the OS)."""

    plan_id: int
    free_memory: bool = False
    kind: ClassVar[CopyKind] = CopyKind.CLEAR
    num_blocks: ClassVar[int] = 0


@dataclass(slots=True)
class RestoreTask:
    """A weight update is done: every rank re-attaches its tiers and reopens storage under the
    new weights' namespace."""

    plan_id: int
    weights_version: str
    kind: ClassVar[CopyKind] = CopyKind.RESTORE
    num_blocks: ClassVar[int] = 0


@dataclass(slots=True)
class LookupTask:
    """Which keys storage holds: ``keys`` are consecutive chains of ``chain_lengths`` keys each;
    the answer is, per chain, how many of its leading keys are stored."""

    plan_id: int
    chain_lengths: np.ndarray
    keys: tuple[bytes, ...]
    kind: ClassVar[CopyKind] = CopyKind.LOOKUP

    def __post_init__(self) -> None:
        self.chain_lengths = np.ascontiguousarray(self.chain_lengths, dtype=np.int32)
        if (self.chain_lengths < 0).any() | (int(self.chain_lengths.sum()) != len(self.keys)):
            raise ValueError(f"LOOKUP's chain lengths {self.chain_lengths.tolist()[:8]} must be >= 0 and sum to "
                             f"its {len(self.keys)} keys")

    @property
    def num_blocks(self) -> int:
        return len(self.chain_lengths)


Task = CopyPlan | ClearTask | RestoreTask | LookupTask


def task_of(task_id: int, kind: CopyKind, src=(), dst=(), keys: tuple[bytes, ...] = ()) -> Task:
    """The task a wire message (kind, src, dst, keys) stands for. ValueError if inconsistent."""
    if kind in COPIES:
        keys = tuple(keys)
        if kind in (CopyKind.SWAP_OUT, CopyKind.SWAP_IN) and keys:
            if len(keys) != 1 or not keys[0].startswith(GROUP) or not keys[0][len(GROUP):].isdigit():
                raise ValueError(f"{kind.name} takes no keys or one {GROUP!r} key, got {keys[:2]!r}")
            return CopyPlan(task_id, kind, src, dst, group=int(keys[0][len(GROUP):]))
        return CopyPlan(task_id, kind, src, dst, keys)
    if kind is CopyKind.CLEAR:
        if tuple(keys) not in ((), (FREE,)):
            raise ValueError(f"CLEAR takes no keys or {FREE!r}, got {tuple(keys)[:2]!r}")
        return ClearTask(task_id, free_memory=bool(keys))
    if kind is CopyKind.RESTORE:
        if not keys:
            raise ValueError("RESTORE needs the new weights version in keys[0]")
        version = keys[0].decode("utf-8")
        if not version:
            raise ValueError("RESTORE: the weights version in keys[0] is empty")
        return RestoreTask(task_id, version)
    if kind is CopyKind.LOOKUP:
        return LookupTask(task_id, src, tuple(keys))
    raise ValueError(f"unknown task kind {kind!r}")


def wire_fields(task: Task) -> tuple[np.ndarray | tuple, np.ndarray | tuple, tuple[bytes, ...]]:
    """(src, dst, keys) of a task on the wire: ``task_of``'s inverse."""
    if type(task) is CopyPlan:
        if task.group >= 0:
            return task.src, task.dst, (GROUP + str(task.group).encode(),)
        return task.src, task.dst, task.keys
    if type(task) is ClearTask:
        return (), (), (FREE,) if task.free_memory else ()
    if type(task) is RestoreTask:
        return (), (), (task.weights_version.encode("utf-8"),)
    if type(task) is LookupTask:
        return task.chain_lengths, (), task.keys
    raise TypeError(f"not a task: {type(task).__name__}")


# ---- what CacheManager's calls return to the scheduler
class Allocation(NamedTuple):
    block_table: tuple[int, ...]
    num_cached_tokens: int  # valid on the device now (device prefix hit)
    num_pending_tokens: int  # arriving by copies (host / storage hit); valid once ready
    plans: tuple[CopyPlan, ...]
    ready: bool  # False: wait for Completion.ready before running a step


class Growth(NamedTuple):
    new_blocks: tuple[int, ...]
    plans: tuple[CopyPlan, ...]  # write-back of evicted blocks
    ready: bool


class Ready(NamedTuple):
    request_id: object
    num_computed_tokens: int  # tokens whose KV is valid: compute from here (a failed copy lowers it)


class Completion(NamedTuple):
    plans: tuple[CopyPlan, ...] = ()  # follow-ups to dispatch now
    ready: tuple[Ready, ...] = ()
    offloaded: tuple[object, ...] = ()  # offload finished: device blocks released
    offload_failed: tuple[object, ...] = ()  # offload failed: still RUNNING on its device blocks


class PreemptionWork(NamedTuple):
    copy_blocks: int  # blocks an offload would copy out (and back in)
    recompute_tokens: int  # tokens a recompute would compute again, if its host copies last
    # Tokens a recompute counts on finding in host copies that it does not hold: an offload pins
    # them until the restore; after a recompute they are only cached, and evicted as any other.
    unheld_tokens: int

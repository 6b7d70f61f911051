"""Copy plans: what the cache core asks the transfer processes to move.

The cache core never copies bytes. It returns a ``CopyPlan``, marks the plan's blocks
IN_FLIGHT, and later receives ``complete(plan, ok)``. The transfer layer carries a plan
to every rank under one task id; each rank copies its own shard of the same block ids.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np


class CopyKind(IntEnum):
    SWAP_OUT = 1  # device -> host: src device ids, dst host ids
    SWAP_IN = 2  # host -> device: src host ids, dst device ids
    STORE = 3  # host -> storage: src host ids, keys
    LOAD = 4  # storage -> host: dst host ids, keys
    CLEAR = 5  # weight update: drop device/host contents
    RESTORE = 6  # weight update done: re-attach and accept work again
    LOOKUP = 7  # which keys storage holds: src = key counts of consecutive chains, keys (fastkv.storage.lookup)


@dataclass(slots=True)
class CopyPlan:
    plan_id: int
    kind: CopyKind
    src: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    dst: np.ndarray = field(default_factory=lambda: np.empty(0, np.int32))
    keys: tuple[bytes, ...] = ()  # storage keys, one per block, for STORE and LOAD

    def __post_init__(self) -> None:
        if type(self.kind) is not CopyKind:  # CopyKind(member) costs a microsecond or two per task
            self.kind = CopyKind(self.kind)
        self.src = np.ascontiguousarray(self.src, dtype=np.int32)
        self.dst = np.ascontiguousarray(self.dst, dtype=np.int32)
        if self.kind in (CopyKind.SWAP_OUT, CopyKind.SWAP_IN) and len(self.src) != len(self.dst):
            raise ValueError(f"{self.kind.name} plan needs as many src as dst ids: {len(self.src)} != {len(self.dst)}")
        if self.kind is CopyKind.STORE and len(self.keys) != len(self.src):
            raise ValueError(f"STORE plan needs one key per src block: {len(self.keys)} != {len(self.src)}")
        if self.kind is CopyKind.LOAD and len(self.keys) != len(self.dst):
            raise ValueError(f"LOAD plan needs one key per dst block: {len(self.keys)} != {len(self.dst)}")
        if self.kind is CopyKind.LOOKUP and (self.src < 0).any() | (int(self.src.sum()) != len(self.keys)):
            raise ValueError(f"LOOKUP plan's chain lengths {self.src.tolist()[:8]} must be >= 0 and sum to its "
                             f"{len(self.keys)} keys")

    @property
    def num_blocks(self) -> int:
        return max(len(self.src), len(self.dst))

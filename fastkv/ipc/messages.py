"""The typed messages of fastkv's channels (wire format: ``fastkv.ipc.codec``).

| message   | channel                                  | type id |
|-----------|------------------------------------------|---------|
| TaskMsg   | task: engine -> transfer[r] (broadcast)   | 1       |
| DoneMsg   | done: transfer[r] -> engine               | 2       |
| PlanMsg   | plan: engine -> worker[r] (broadcast)     | 3       |
| OutputMsg | output: worker[0] -> engine               | 4       |

To add a field: append ``name:kind`` to ``WIRE`` and the dataclass field (same order).
To add a message: a new dataclass with ``WIRE`` and ``@message(<unused id>)``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import numpy as np

from fastkv.ipc.codec import message

_EMPTY = np.empty(0, np.int32)
_EMPTY.setflags(write=False)
_EMPTY64 = np.empty(0, np.int64)
_EMPTY64.setflags(write=False)


def _empty() -> np.ndarray:
    return _EMPTY  # shared and read-only, like decoded arrays


@message(1)
@dataclass(slots=True)
class TaskMsg:
    """One copy task; every rank receives the same message and copies its own shard
    (``fastkv.transfer.protocol`` converts it to and from a ``CopyPlan``)."""

    WIRE: ClassVar[str] = "task_id:i64 kind:i32 src:i32[] dst:i32[] keys:bytes[] layered:i64"
    task_id: int
    kind: int  # fastkv.cache.plan.CopyKind
    src: np.ndarray = field(default_factory=_empty)
    dst: np.ndarray = field(default_factory=_empty)
    keys: tuple[bytes, ...] = ()
    # SWAP_IN only: 0 copies it whole; n > 0 copies it layer by layer, the engine's n-th such
    # task, acked once verified and announced per layer on the rank's landed counter
    # (``fastkv.ipc.landed``)
    layered: int = 0


@message(2)
@dataclass(slots=True)
class DoneMsg:
    """One rank's acknowledgement of a task."""

    WIRE: ClassVar[str] = "task_id:i64 rank:i32 ok:bool nbytes:i64 seconds:f64 error:str found:bytes"
    task_id: int
    rank: int
    ok: bool
    nbytes: int = 0
    seconds: float = 0.0
    error: str = ""
    # LOOKUP: per key chain, how many leading keys this rank holds (raw int32, so acks still compare with ==)
    found: bytes = b""

    @property
    def found_counts(self) -> np.ndarray:
        return np.frombuffer(self.found, np.int32)


@message(3)
@dataclass(slots=True)
class PlanMsg:
    """One scheduler step for the workers; per request (same order in every list): its
    id, the token ids to compute this step, its full block table, and how many of its
    tokens already have KV (computed or loaded from cache).

    ``sample``: per request 1 if this step ends its known tokens (sample the next one),
    else 0 (a prefill chunk); empty means every request samples (a pure decode step, the
    common case, costs no bytes). ``release``: requests finished since the last plan,
    whose per-request runner state may go (``ModelRunner.release``). ``control``: a
    request to every rank instead of a step (JSON, ``fastkv.engine.protocol``: the
    weight-update hook); empty for a step. ``params``: per request, on the first plan that
    carries it, a JSON object with its caller's id and sampling parameters, "" on later plans;
    empty when no request in the step is new (``fastkv.engine.worker_api`` reads it)."""

    WIRE: ClassVar[str] = ("step_id:i64 request_ids:str[] token_ids:i32[][] block_tables:i32[][] num_computed:i32[] "
                           "sample:i32[] release:str[] control:str params:str[] wait_landed:i64[]")
    step_id: int
    request_ids: list[str] = field(default_factory=list)
    token_ids: list[np.ndarray] = field(default_factory=list)
    block_tables: list[np.ndarray] = field(default_factory=list)
    num_computed: np.ndarray = field(default_factory=_empty)
    sample: np.ndarray = field(default_factory=_empty)
    release: list[str] = field(default_factory=list)
    control: str = ""
    params: list[str] = field(default_factory=list)
    # per rank, the last layered SWAP_IN it acked before this plan (empty: none): layer l of this
    # step reads KV on rank r only once layer l of task wait_landed[r] landed (``fastkv.ipc.landed``)
    wait_landed: np.ndarray = field(default_factory=lambda: _EMPTY64)

    def __post_init__(self) -> None:
        n = len(self.request_ids)
        if len(self.params) not in (0, n):
            raise ValueError(f"PlanMsg step {self.step_id}: {len(self.params)} params for {n} requests")
        if not (len(self.token_ids) == len(self.block_tables) == len(self.num_computed) == n):
            raise ValueError(
                f"PlanMsg step {self.step_id}: per-request lists differ in length: request_ids {n}, token_ids "
                f"{len(self.token_ids)}, block_tables {len(self.block_tables)}, num_computed {len(self.num_computed)}"
            )
        if len(self.sample) not in (0, n):
            raise ValueError(f"PlanMsg step {self.step_id}: {len(self.sample)} sample flags for {n} requests")


@message(4)
@dataclass(slots=True)
class OutputMsg:
    """Worker 0's result of one step: one sampled token per request (same order as the
    step's PlanMsg), and step statistics."""

    WIRE: ClassVar[str] = "step_id:i64 num_batched_tokens:i64 seconds:f64 request_ids:str[] tokens:i32[] error:str"
    step_id: int
    num_batched_tokens: int = 0
    seconds: float = 0.0
    request_ids: list[str] = field(default_factory=list)
    tokens: np.ndarray = field(default_factory=_empty)
    error: str = ""

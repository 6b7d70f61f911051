"""Preemption by offload for a hybrid layout: ``GroupedManager``'s copies in flight, per request.

An offload or a restore (``fastkv.cache.group_tiers``) is one SWAP per KV cache group that
holds blocks, each plan tagged with its group (``CopyPlan.group``: its ids are that group's, its
bytes that group's layers). The request's offload or restore is done when every group's copy
is, and succeeded only if all did. Meanwhile its blocks are in no group's free list (the group
core does not pin them): a request freed, or a restore preempted, while its copies fly is let
go of only once they land, so no copy writes a block another request has taken.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from fastkv.cache import group_tiers
from fastkv.cache.group_tiers import GroupCopy
from fastkv.cache.groups import GroupedCache
from fastkv.cache.plan import CopyKind, CopyPlan


@dataclass
class Flight:
    """One request's offload or restore while its copies fly."""

    kind: CopyKind  # SWAP_OUT: an offload, SWAP_IN: a restore
    plans: set[int] = field(default_factory=set)
    ok: bool = True
    cancelled: bool = False  # a restore preempted in flight: OFFLOADED again once its copies land
    freed: bool = False  # freed in flight: let go of once its copies land


class GroupCopies:
    """The copies in flight of the requests of one ``GroupedCache``."""

    def __init__(self, groups: GroupedCache) -> None:
        self.groups = groups
        self.flights: dict[object, Flight] = {}
        self._owner: dict[int, object] = {}  # plan id -> request

    def start(self, request_id: object, kind: CopyKind, copies: list[GroupCopy]) -> tuple[CopyPlan, ...]:
        """The plans to hand out (a group holding no blocks copies nothing); with none, the
        offload or restore is done at once."""
        plans = tuple(c.plan for c in copies if c.plan.num_blocks)
        if not plans:
            done = group_tiers.offloaded if kind is CopyKind.SWAP_OUT else group_tiers.restored
            done(self.groups, request_id, True)
            return ()
        self.flights[request_id] = Flight(kind, {p.plan_id for p in plans})
        for p in plans:
            self._owner[p.plan_id] = request_id
        return plans

    def in_flight(self) -> set[int]:
        return set(self._owner)

    def landed(self, plan: CopyPlan, ok: bool) -> tuple[object, Flight] | None:
        """One group's copy is done; (request, its flight) once the request's last one is."""
        request_id = self._owner.pop(plan.plan_id, None)
        if request_id is None:
            raise ValueError(f"copy plan {plan.plan_id} is not in flight (never planned, or completed)")
        f = self.flights[request_id]
        f.plans.discard(plan.plan_id)
        f.ok = f.ok and bool(ok)
        if f.plans:
            return None
        del self.flights[request_id]
        return request_id, f

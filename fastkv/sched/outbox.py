"""The copy outbox: plans the cache returned, queued until ``step()`` hands them out, then in
flight until ``on_copy_complete``."""
from __future__ import annotations

from collections.abc import Iterable

from fastkv.cache.plan import CopyPlan


class CopyOutbox:
    def __init__(self) -> None:
        self.queued: list[CopyPlan] = []
        self.in_flight: dict[int, CopyPlan] = {}

    def emit(self, plans: Iterable[CopyPlan]) -> None:
        self.queued.extend(plans)

    def hand_out(self) -> list[CopyPlan]:
        """Every queued plan, now in flight."""
        plans, self.queued = self.queued, []
        for p in plans:
            self.in_flight[p.plan_id] = p
        return plans

    def complete(self, plan_id: object) -> CopyPlan | None:
        """The plan in flight under ``plan_id`` (no longer), or None."""
        return self.in_flight.pop(plan_id, None) if isinstance(plan_id, int) else None

    def plan_ids(self) -> list[int]:
        """Queued and in flight (a plan in both would be listed twice)."""
        return [p.plan_id for p in self.queued] + list(self.in_flight)

    def __bool__(self) -> bool:
        return bool(self.queued or self.in_flight)

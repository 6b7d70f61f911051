"""The waiting queue and the victim order.

Waiting requests (never admitted, preempted to recompute, or offloaded) are admitted in
order of ``(priority, arrival)`` with the priority policy, else of arrival alone. A preempted
request keeps its arrival number, so it resumes before requests that came after it.
Victims are the opposite end: the most recently admitted running request (vLLM and
FastDeploy's rule), or with the priority policy the least important, latest admitted one.
"""
from __future__ import annotations

from bisect import insort
from collections.abc import Iterable, Iterator
from enum import IntEnum

from fastkv.sched.request import Request


class QueuePolicy(IntEnum):
    FCFS = 1
    PRIORITY = 2


class WaitingQueue:
    """Requests waiting for admission, kept sorted; removal is O(n) (aborts and admissions of
    the head are the common case, and queues are thousands long at most)."""

    def __init__(self, policy: QueuePolicy) -> None:
        self.policy = QueuePolicy(policy)
        self._items: list[tuple[int, int, int]] = []  # (priority, arrival_seq, request_id)
        self._reqs: dict[int, Request] = {}

    def _key(self, req: Request) -> tuple[int, int, int]:
        prio = req.priority if self.policy is QueuePolicy.PRIORITY else 0
        return (prio, req.arrival_seq, req.request_id)

    def push(self, req: Request) -> None:
        assert req.request_id not in self._reqs, f"request {req.request_id} queued twice"
        self._reqs[req.request_id] = req
        insort(self._items, self._key(req))

    def remove(self, req: Request) -> None:
        del self._reqs[req.request_id]
        self._items.remove(self._key(req))

    def __contains__(self, req: Request) -> bool:
        return self._reqs.get(req.request_id) is req

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[Request]:
        """In admission order, over a snapshot (the caller may remove while iterating)."""
        reqs = self._reqs
        return iter([reqs[rid] for _, _, rid in self._items])


def victim_key(policy: QueuePolicy, req: Request) -> tuple[int, int]:
    """Larger is preempted first."""
    if policy is QueuePolicy.PRIORITY:
        return (req.priority, req.admit_seq)
    return (0, req.admit_seq)


def pick_victim(policy: QueuePolicy, candidates: Iterable[Request], exclude: Request | None = None) -> Request | None:
    best, best_key = None, None
    for r in candidates:
        if r is exclude:
            continue
        k = victim_key(policy, r)
        if best_key is None or k > best_key:
            best, best_key = r, k
    return best

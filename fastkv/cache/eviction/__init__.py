"""Eviction policies: the order in which a pool's CACHED blocks are evicted.

A pool keeps its evictable (CACHED) blocks in one ``EvictionPolicy`` queue and never touches
the queue's internals. To add a policy, write one module here with a class and add one line to
``POLICIES``; select it with ``CacheConfig.eviction`` (``RunSpec.eviction``, ``--eviction``).
Most policies are a rank per block (``base.RankedQueue``: say which bucket a block used ``n``
times goes to, as SGLang's priority keys do; ``lfu.py`` is a few lines);
a policy of another shape implements ``EvictionPolicy`` itself (``lru.py``, the default, is a
linked list, the fastest for one bucket).

The leaves-first contract, which the prefix index relies on (see ``fastkv.cache.index``):
matching walks a chain of keys from its root, so a child whose parent was evicted can never
be hit again. Callers queue a request's blocks children first (a table is released last to
first, in one ``extend``), and a hit takes a whole run, parents included, out of the queue.
A policy must therefore evict, among blocks queued with no access in between, the one queued
earlier first: ``extend([child, parent])`` followed by ``popleft_many(1)`` returns the child.
Accesses (``touch``, or ``remove`` and a later ``append``) may reorder blocks; a policy that
ranks by access count must rank a parent at least as high as its children, which holds
because every hit on a child is also a hit on its parent.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from importlib import import_module
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    capacity: int

    def __len__(self) -> int: ...

    def __contains__(self, block: int) -> bool: ...

    def __iter__(self) -> Iterator[int]:
        """Queued blocks in eviction order, next victim first (checks and tests only)."""

    def append(self, block: int) -> None:
        """``block`` became evictable (its last holder or copy let go of it)."""

    def extend(self, blocks: list[int]) -> None:
        """``append`` each block in order (the hot path of releasing a request's table)."""

    def remove(self, block: int) -> None:
        """``block`` is no longer evictable: a prefix hit holds it, a copy pins it, or its key
        was dropped."""

    def touch(self, block: int) -> None:
        """An access to a queued block that does not hold it (a duplicate's release refreshes
        the block holding its key)."""

    def forget(self, block: int) -> None:
        """``block``'s contents are gone (it is FREE, or about to hold new contents): whatever
        the policy learned about it no longer applies. ``block`` is not queued."""

    def requeue(self, block: int) -> None:
        """``block``, just dequeued as the next victim, is not evicted after all (a parent met at
        the head with children left): it goes back to the young end, keeping what the policy
        learned about it."""

    def popleft(self) -> int | None:
        """Dequeue the next victim; None when empty. Unless it is ``requeue``d, its contents go:
        a later ``append`` starts afresh."""

    def popleft_many(self, n: int) -> list[int]:
        """Dequeue the next ``n`` victims in order; ``n <= len(self)``."""

    def check_integrity(self) -> None: ...


def _policy(module: str, cls: str) -> Callable[[int], EvictionPolicy]:
    return getattr(import_module(f"{__name__}.{module}"), cls)


POLICIES: dict[str, Callable[[int], EvictionPolicy]] = {  # one line per policy: name, module, class
    "lru": _policy("lru", "LRUQueue"),
    "lfu": _policy("lfu", "LFUQueue"),
    "slru": _policy("slru", "SLRUQueue"),
}


def make_policy(name: str, capacity: int) -> EvictionPolicy:
    try:
        factory = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}: one of {sorted(POLICIES)}") from None
    return factory(capacity)

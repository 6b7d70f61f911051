"""The store backlog: which optional STOREs to make when the storage tier is behind.

A write policy's STOREs (THROUGH, BACK) are optional: the host holds the bytes either way. When
storage is slower than the engine makes blocks, some must be skipped, and what the pool loses
should be what is worth least to a restart or another engine. In that order:

1. ``already_stored``: the pool holds the key (this engine stored it, or a lookup found another's):
   skipped always, at no loss.
2. ``tail``: a block of an unshared suffix, past the chain's first ``NEAR_ROOT_BLOCKS``: only the
   request that computed it (or one repeating its whole prefix) can hit it. Deeper ones first.
3. ``shared``: a block more than one request holds (its host or device refcount), one with more
   than one child here (a branch point), or one near the chain's root, where prompts share
   their system prompt and preamble: every request with that prefix hits it.

A skipped block is deferred, not dropped: its host copy still holds the bytes, so it is stored
once the STOREs in flight have drained to half of what tails may fill (``DeferredStores``, best
first). Only one whose host copy was evicted meanwhile, or that is still waiting when the run
ends, is lost to the pool, and counted by reason.

The order holds across calls, not only within one: a tail may take only the first
``TAIL_SHARE`` of the backlog, so shared blocks find room while tails are being skipped. Within a
call the blocks go shared first, then tails by depth (a chain's order). A block's depth is how
far its parents are still known in the tiers (``PrefixIndex.parents``), looked at up to
``NEAR_ROOT_BLOCKS``: a chain whose parents left every tier looks nearer its root than it is,
which errs toward storing it.

A request preempted in storage mode is stored whatever the backlog (``storage_writes``): it
resumes from what was written. This module only ranks and counts.
"""
from __future__ import annotations

import math

from fastkv.cache.pool import BlockPool

NEAR_ROOT_BLOCKS = 4  # a chain's first blocks: what most prompts with a common preamble share
TAIL_SHARE = 0.5  # of the backlog, what unshared tails may fill: the rest is kept for shared blocks
SHARED, TAIL = 0, 1  # value classes, most valuable first
REASONS = ("already_stored", "tail", "shared")  # why a block was not stored (CacheStats.skipped_by)


def rank(host: BlockPool, device: BlockPool, parents: dict[bytes, bytes], block: int, key: bytes) -> tuple[int, int]:
    """(value class, depth up to NEAR_ROOT_BLOCKS) of host ``block`` keyed ``key``: lower is kept first."""
    depth, k = 0, key
    while depth < NEAR_ROOT_BLOCKS and (k := parents.get(k)) is not None:
        depth += 1
    d = device.lookup.get(key)
    if depth < NEAR_ROOT_BLOCKS or host.ref[block] > 1 or (d is not None and device.ref[d] > 1) \
            or len(host.children(key)) > 1:
        return SHARED, depth
    return TAIL, depth


def admit(ranks: list[tuple[int, int]], in_flight: int, backlog: int) -> list[bool]:
    """Which of a call's blocks (in chain order, with their ``rank``) to STORE, ``in_flight`` STORE
    blocks already in flight: best first, each while its class's share of ``backlog`` has room."""
    caps = (backlog, math.ceil(backlog * TAIL_SHARE))
    keep = [False] * len(ranks)
    used = in_flight
    for i in sorted(range(len(ranks)), key=lambda i: (*ranks[i], i)):
        if used < caps[ranks[i][0]]:
            keep[i] = True
            used += 1
    return keep


class DeferredStores:
    """Optional STOREs skipped while storage was behind: key -> its ``rank`` then. The host still
    holds their bytes, so they are made once the STOREs in flight drain (``storage_writes.catch_up``),
    best first; one whose host copy is gone by then is lost to the pool."""

    __slots__ = ("ranks",)

    def __init__(self) -> None:
        self.ranks: dict[bytes, tuple[int, int]] = {}

    def __len__(self) -> int:
        return len(self.ranks)

    def defer(self, key: bytes, rank: tuple[int, int]) -> None:
        self.ranks[key] = rank

    def take_all(self) -> list[tuple[bytes, tuple[int, int]]]:
        """Every deferred key with its rank, best first (the order deferred breaks ties); forgets them."""
        items = sorted(self.ranks.items(), key=lambda kv: kv[1])
        self.ranks = {}
        return items

    def count(self) -> dict[str, int]:
        """The deferred keys by reason (``tail``, ``shared``): what the pool misses while they wait."""
        tails = sum(1 for value, _ in self.ranks.values() if value == TAIL)
        return {"tail": tails, "shared": len(self.ranks) - tails}

"""SLRU eviction (segmented LRU): a block used once waits in a probation segment, evicted
first; one used again (a prefix hit) moves to a protected segment of at most 80% of the tier,
whose oldest block goes back to probation's young end when it overflows. A scan of one-off
prompts then flushes probation only, not the prefixes hit before."""
from __future__ import annotations

from fastkv.cache.eviction.base import RankedQueue


class SLRUQueue(RankedQueue):
    __slots__ = ()
    caps = {1: 0.8}

    def rank(self, uses: int) -> int:
        return 0 if uses == 1 else 1

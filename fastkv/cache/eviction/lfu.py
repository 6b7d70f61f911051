"""LFU eviction: the block used the fewest times goes first, the least recently queued of
those on a tie (so a request's table, queued children first, still leaves leaves first).

A block's count is the number of times it became evictable or was touched since its contents
were last replaced (``forget``): each release after a prefix hit counts once."""
from __future__ import annotations

from fastkv.cache.eviction.base import RankedQueue


class LFUQueue(RankedQueue):
    __slots__ = ()

    def rank(self, uses: int) -> int:
        return uses

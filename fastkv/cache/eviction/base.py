"""The shape of most eviction policies: a rank per block, from how often it was used.

A ``RankedQueue`` keeps its queued blocks in buckets, one insertion-ordered dict per rank, and
evicts the block queued longest ago in the lowest non-empty bucket. A subclass says only which
bucket a block goes to (``rank``), from its uses since its contents were set (1 on its first
release; each later release, touch or re-queue adds one; a parent passed over at the head,
``requeue``, keeps its count and goes to the young end of its bucket), and optionally caps a bucket's share
of the capacity (``caps``): a bucket over its cap sends its oldest block down one rank. LFU
ranks by the count itself; SLRU by "used once or more"; LRU is one bucket (fastkv keeps a
faster linked list for it, ``lru.py``).

Every operation is O(1) but finding the next non-empty bucket once the lowest empties
(O(buckets)). The leaves-first contract (``fastkv.cache.eviction``) holds when ``rank`` never
ranks a block used more often lower: every hit on a child is also a hit on its parent.
"""
from __future__ import annotations

from collections.abc import Iterator


class RankedQueue:
    __slots__ = ("capacity", "uses", "where", "buckets", "low", "_len", "_caps")
    caps: dict[int, float] = {}  # rank -> the largest share of the capacity its bucket may hold

    def rank(self, uses: int) -> int:
        """The bucket of a block queued or touched for the ``uses``-th time (``uses >= 1``)."""
        raise NotImplementedError

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"{type(self).__name__} capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.uses = [0] * capacity  # uses of each block's current contents
        self.where = [-1] * capacity  # the rank a block is queued under; -1: not queued
        self.buckets: dict[int, dict[int, None]] = {}  # rank -> blocks, oldest queued first
        self.low = 0  # the lowest rank with a non-empty bucket (when any)
        self._len = 0
        self._caps = {r: max(1, int(share * capacity)) for r, share in self.caps.items()}

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self.capacity and self.where[block] >= 0

    def _queue(self, block: int, r: int) -> None:
        bucket = self.buckets.get(r)
        if bucket is None:
            bucket = self.buckets[r] = {}
        bucket[block] = None
        self.where[block] = r
        if self._len == 0 or r < self.low:
            self.low = r
        self._len += 1
        cap = self._caps.get(r)
        if cap is not None and len(bucket) > cap:
            oldest = next(iter(bucket))
            self._unqueue(oldest)
            self._queue(oldest, r - 1)

    def _unqueue(self, block: int) -> None:
        r = self.where[block]
        bucket = self.buckets[r]
        del bucket[block]
        self.where[block] = -1
        self._len -= 1
        if not bucket:
            del self.buckets[r]
            if r == self.low and self.buckets:
                self.low = min(self.buckets)

    def append(self, block: int) -> None:
        assert self.where[block] < 0, f"{type(self).__name__}.append: block {block} is already queued"
        u = self.uses[block]
        u = u + 1 if u >= 0 else 1  # negative: dequeued as a victim (popleft), its contents gone
        self.uses[block] = u
        self._queue(block, self.rank(u))

    def requeue(self, block: int) -> None:
        assert self.where[block] < 0 and self.uses[block] < 0, \
            f"{type(self).__name__}.requeue: block {block} was not just dequeued"
        u = self.uses[block] = -self.uses[block]
        self._queue(block, self.rank(u))

    def extend(self, blocks: list[int]) -> None:
        for b in blocks:
            self.append(b)

    def remove(self, block: int) -> None:
        assert block in self, f"{type(self).__name__}.remove: block {block} is not queued"
        self._unqueue(block)

    def touch(self, block: int) -> None:
        self._unqueue(block)
        self.append(block)

    def forget(self, block: int) -> None:
        self.uses[block] = 0

    def popleft(self) -> int | None:
        if not self._len:
            return None
        block = next(iter(self.buckets[self.low]))
        self._unqueue(block)
        self.uses[block] = -self.uses[block]  # kept for a requeue; else its next contents start afresh
        return block

    def popleft_many(self, n: int) -> list[int]:
        assert 0 <= n <= self._len, f"{type(self).__name__}.popleft_many({n}) with {self._len} queued"
        return [self.popleft() for _ in range(n)]

    def __iter__(self) -> Iterator[int]:
        for r in sorted(self.buckets):
            yield from self.buckets[r]

    def check_integrity(self) -> None:
        name, seen = type(self).__name__, 0
        for r, bucket in self.buckets.items():
            assert bucket, f"{name}: empty bucket for rank {r}"
            assert len(bucket) <= self._caps.get(r, self.capacity), f"{name}: bucket {r} over its cap"
            for b in bucket:
                assert self.where[b] == r and self.uses[b] > 0, f"{name}: block {b} in bucket {r} misfiled"
            seen += len(bucket)
        assert seen == self._len, f"{name}: {seen} queued blocks but length {self._len}"
        assert seen == sum(1 for r in self.where if r >= 0), f"{name}: a block marked queued is in no bucket"
        assert not self.buckets or self.low == min(self.buckets), f"{name}: low {self.low} is not the lowest rank"

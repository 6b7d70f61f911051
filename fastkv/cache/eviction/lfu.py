"""LFU eviction: the block used the fewest times goes first, the least recently queued of
those on a tie (so a request's table, queued children first, still leaves leaves first).

A block's count is the number of times it became evictable or was touched since its contents
were last replaced (``forget``): each release after a prefix hit counts once. One insertion
ordered dict per count keeps every operation O(1) except finding the next non-empty count
after the lowest one empties (O(distinct counts)).
"""
from __future__ import annotations

from collections.abc import Iterator


class LFUQueue:
    __slots__ = ("capacity", "count", "buckets", "low", "_len")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"LFUQueue capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.count = [0] * capacity  # uses of each block's current contents
        self.buckets: dict[int, dict[int, None]] = {}  # count -> blocks, oldest queued first
        self.low = 0  # the lowest count with a non-empty bucket (when any)
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        if not 0 <= block < self.capacity:
            return False
        bucket = self.buckets.get(self.count[block])
        return bucket is not None and block in bucket

    def _queue(self, block: int, count: int) -> None:
        bucket = self.buckets.get(count)
        if bucket is None:
            bucket = self.buckets[count] = {}
        bucket[block] = None
        if self._len == 0 or count < self.low:
            self.low = count
        self._len += 1

    def _unqueue(self, block: int) -> None:
        count = self.count[block]
        bucket = self.buckets[count]
        del bucket[block]
        self._len -= 1
        if not bucket:
            del self.buckets[count]
            if count == self.low and self.buckets:
                self.low = min(self.buckets)

    def append(self, block: int) -> None:
        assert block not in self, f"LFUQueue.append: block {block} is already queued"
        self.count[block] += 1
        self._queue(block, self.count[block])

    def extend(self, blocks: list[int]) -> None:
        for b in blocks:
            self.append(b)

    def remove(self, block: int) -> None:
        assert block in self, f"LFUQueue.remove: block {block} is not queued"
        self._unqueue(block)

    def touch(self, block: int) -> None:
        self._unqueue(block)
        self.count[block] += 1
        self._queue(block, self.count[block])

    def forget(self, block: int) -> None:
        self.count[block] = 0

    def popleft(self) -> int:
        if not self._len:
            return -1
        block = next(iter(self.buckets[self.low]))
        self._unqueue(block)
        self.count[block] = 0  # evicted: its next contents start afresh
        return block

    def popleft_many(self, n: int) -> list[int]:
        assert 0 <= n <= self._len, f"LFUQueue.popleft_many({n}) with {self._len} queued"
        return [self.popleft() for _ in range(n)]

    def __iter__(self) -> Iterator[int]:
        for count in sorted(self.buckets):
            yield from self.buckets[count]

    def check_integrity(self) -> None:
        seen = 0
        for count, bucket in self.buckets.items():
            assert bucket, f"LFUQueue: empty bucket for count {count}"
            for b in bucket:
                assert self.count[b] == count, f"LFUQueue: block {b} in bucket {count} has count {self.count[b]}"
            seen += len(bucket)
        assert seen == self._len, f"LFUQueue: {seen} queued blocks but length {self._len}"
        assert not self.buckets or self.low == min(self.buckets), f"LFUQueue: low {self.low} is not the lowest count"

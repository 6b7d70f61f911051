"""LRU eviction (the default): an O(1) queue of block ids that allocates nothing per operation.

The queue is an intrusive doubly linked list over two preallocated Python lists,
``prev`` and ``next``, indexed by block id (vLLM's ``FreeKVCacheBlockQueue`` idea, without a
node object per block). Index ``capacity`` is a sentinel: ``next[sentinel]`` is the least
recently used block (the head, evicted first) and ``prev[sentinel]`` the most recently used
(the tail). ``-1`` in ``next`` marks a block that is not queued.

Why Python lists and not numpy arrays: indexing a numpy array with a Python int builds a
numpy scalar object per read, which is both an allocation and several times slower. A list slot holds
a reference to an int object that already exists (block ids come from the preallocated
``ids`` list), so ``append``/``remove``/``popleft`` only rebind references.
"""
from __future__ import annotations

from collections.abc import Iterator

from fastkv.native.compiled import load

_pool = load("_pool")  # the links of popleft_many and extend (ops/block_pool.c)


class LRUQueue:
    __slots__ = ("capacity", "ids", "prev", "next", "_sentinel", "_len")

    def __init__(self, capacity: int) -> None:
        if not isinstance(capacity, int) or capacity < 0:
            raise ValueError(f"LRUQueue capacity must be an int >= 0, got {capacity!r}")
        self.capacity = capacity
        self.ids = list(range(capacity + 1))  # the int objects every link points at
        s = self.ids[capacity]
        self._sentinel = s
        self.prev = [-1] * (capacity + 1)
        self.next = [-1] * (capacity + 1)
        self.prev[s] = s
        self.next[s] = s
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __contains__(self, block: int) -> bool:
        return 0 <= block < self.capacity and self.next[block] != -1

    def append(self, block: int) -> None:
        """Queue ``block`` as the most recently used."""
        nxt, prv, s = self.next, self.prev, self._sentinel
        assert nxt[block] == -1, f"LRUQueue.append: block {block} is already queued"
        last = prv[s]
        nxt[last] = block
        prv[block] = last
        nxt[block] = s
        prv[s] = block
        self._len += 1

    def remove(self, block: int) -> None:
        nxt, prv = self.next, self.prev
        after = nxt[block]
        assert after != -1, f"LRUQueue.remove: block {block} is not queued"
        before = prv[block]
        nxt[before] = after
        prv[after] = before
        nxt[block] = -1
        prv[block] = -1
        self._len -= 1

    def extend(self, blocks: list[int]) -> None:
        """``append`` each block in order, in one C call (a released table: the pool's hot path);
        ``_extend_reference`` defines it."""
        _pool.lru_extend(self.next, self.prev, self._sentinel, list(blocks))
        self._len += len(blocks)

    def _extend_reference(self, blocks: list[int]) -> None:
        nxt, prv, s = self.next, self.prev, self._sentinel
        last = prv[s]
        for b in blocks:
            nxt[last] = b
            prv[b] = last
            last = b
        nxt[last] = s
        prv[s] = last
        self._len += len(blocks)

    def touch(self, block: int) -> None:
        """Mark a queued block as the most recently used."""
        self.remove(block)
        self.append(block)

    def forget(self, block: int) -> None:
        """LRU keeps nothing about a block once it leaves the queue."""

    def requeue(self, block: int) -> None:
        """Back at the young end: all LRU knows of a block is its place."""
        self.append(block)

    def popleft(self) -> int | None:
        """Dequeue and return the least recently used block; None when empty."""
        nxt, prv, s = self.next, self.prev, self._sentinel
        block = nxt[s]
        if block == s:
            return None
        after = nxt[block]
        nxt[s] = after
        prv[after] = s
        nxt[block] = -1
        prv[block] = -1
        self._len -= 1
        return block

    def popleft_many(self, n: int) -> list[int]:
        """Dequeue the ``n`` least recently used blocks (oldest first); n <= len(self). One C call
        (the eviction of fresh blocks: the pool's hot path); ``_popleft_many_reference`` defines it."""
        assert 0 <= n <= self._len, f"LRUQueue.popleft_many({n}) with {self._len} queued"
        out = _pool.lru_popleft(self.next, self.prev, self._sentinel, n)
        self._len -= n
        return out

    def _popleft_many_reference(self, n: int) -> list[int]:
        assert 0 <= n <= self._len, f"LRUQueue.popleft_many({n}) with {self._len} queued"
        nxt, prv, s = self.next, self.prev, self._sentinel
        out = []
        append = out.append
        block = nxt[s]
        for _ in range(n):
            after = nxt[block]
            nxt[block] = -1
            prv[block] = -1
            append(block)
            block = after
        nxt[s] = block
        prv[block] = s
        self._len -= n
        return out

    def peek(self) -> int | None:
        """The least recently used block without dequeuing it; None when empty."""
        block = self.next[self._sentinel]
        return None if block == self._sentinel else block

    def __iter__(self) -> Iterator[int]:
        """Blocks from least to most recently used (for checks and tests, not hot paths)."""
        nxt, s = self.next, self._sentinel
        block = nxt[s]
        while block != s:
            yield block
            block = nxt[block]

    def check_integrity(self) -> None:
        nxt, prv, s = self.next, self.prev, self._sentinel
        seen = 0
        block = s
        while True:
            after = nxt[block]
            assert after != -1 and prv[after] == block, f"LRUQueue: broken link after {block}"
            block = after
            if block == s:
                break
            seen += 1
            assert seen <= self.capacity, "LRUQueue: cycle that misses the sentinel"
        assert seen == self._len, f"LRUQueue: {seen} linked blocks but length {self._len}"
        unlinked = sum(1 for b in range(self.capacity) if nxt[b] == -1)
        assert unlinked == self.capacity - seen, "LRUQueue: a block has next == -1 but prev set, or vice versa"
        assert all((nxt[b] == -1) == (prv[b] == -1) for b in range(self.capacity)), "LRUQueue: half-linked block"

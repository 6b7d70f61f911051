"""A hashed block pool for one tier (device or host).

Every block is in exactly one state::

    FREE       refcount 0, no key, on the free stack
    ALLOCATED  refcount > 0, held by requests; may carry a key (its bytes are valid for it)
    CACHED     refcount 0, keyed, in the eviction queue: evictable, and reusable by a prefix hit
    IN_FLIGHT  pinned by one or more copies (refcount may be > 0): never handed out, evicted
               or freed until the last copy completes

``lookup`` maps a key to the one block of this tier holding valid bytes for it; a block's key
is set only once its bytes are valid (after compute, or after a copy succeeded), so a failed
copy never leaves a key pointing at bad bytes. A freed block keeps its key (CACHED) until it
is reused: then it is evicted, in the order of the pool's eviction policy (LRU by default,
see ``fastkv.cache.eviction``).

Releasing the last reference of an IN_FLIGHT block does not free it: the block stays
IN_FLIGHT and turns CACHED or FREE when its last copy completes (``unpin``). That is how the
pool refuses to free a block a copy still reads or writes, without making callers track it.

Leaves first, by construction: ``kids`` names, per parent key, the keyed blocks of this tier
whose key hangs under it, and a None for each child a copy brings there (``children``) (``parents``, shared
with the prefix index, says which key a key hangs under); a loss finds the children it strands
there (``fastkv.cache.strands``). A CACHED block with keyed children here is not evicted: met at the head of the queue,
it goes back to its young end, behind its children, whatever order parent and child reached the
tier in (matching walks from the root, so a child left behind its parent is never hit again).
Only when a whole turn of the queue finds no leaf (every child held or in flight) is a parent
evicted anyway (``forced_evictions``).

Hot paths (``take``, ``incref``, ``release``) work on preallocated Python lists indexed by
block id and allocate no objects, except the tuple reporting an eviction. The three loops every
block of every request passes through (evicting leaves, inserting computed keys, releasing a
table) are C (``fastkv.native._pool``, ops/block_pool.c) over these same lists and dicts; each has its
Python definition beside it (``_*_reference``), which a property test compares it with.
"""
from __future__ import annotations

from enum import IntEnum

from fastkv.cache.eviction import EvictionPolicy, make_policy
from fastkv.native.compiled import load

_pool = load("_pool")


class BlockState(IntEnum):
    FREE = 0
    ALLOCATED = 1
    CACHED = 2
    IN_FLIGHT = 3


_FREE, _ALLOCATED, _CACHED, _IN_FLIGHT = 0, 1, 2, 3
_NONE = object()  # no entry (None is a child a copy brings)


class BlockPool:
    __slots__ = ("tier", "capacity", "state", "ref", "pins", "key", "lookup", "free", "evictable", "num_allocated",
                 "num_in_flight", "parent", "kids", "parents", "forced_evictions",
                 "passed_over")

    def __init__(self, tier: str, capacity: int, eviction: str = "lru") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 0:
            raise ValueError(f"{tier} pool capacity must be an int >= 0, got {capacity!r}")
        self.tier = tier
        self.capacity = capacity
        self.evictable: EvictionPolicy = make_policy(eviction, capacity)
        self.state = [_FREE] * capacity
        self.ref = [0] * capacity
        self.pins = [0] * capacity
        self.key: list[bytes | None] = [None] * capacity
        self.lookup: dict[bytes, int] = {}
        self.free = list(range(capacity - 1, -1, -1))  # a stack: block 0 is handed out first
        self.num_allocated = 0
        self.num_in_flight = 0
        self.parent: list[bytes | None] = [None] * capacity  # the parent key of each keyed block
        # parent key -> its children here (None: one a copy brings): the child itself while it is
        # the only one (a chain's every parent: nothing allocated), a list from the second on
        self.kids: dict[bytes, int | None | list[int | None]] = {}
        self.parents: dict[bytes, bytes] = {}  # key -> parent key (the prefix index's, once attached)
        self.forced_evictions = 0
        self.passed_over = 0  # parents met at the queue's head with children left (sent behind them)

    # ------------------------------------------------------------------ counts
    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_cached(self) -> int:
        return len(self.evictable)

    @property
    def num_available(self) -> int:
        """Blocks ``take`` can hand out now: FREE plus CACHED (evicted on the way)."""
        return len(self.free) + len(self.evictable)

    def _check_id(self, block: int) -> None:
        if not (type(block) is int and 0 <= block < self.capacity):
            raise ValueError(f"{self.tier} block id {block!r} out of range [0, {self.capacity})")

    def block_state(self, block: int) -> BlockState:
        self._check_id(block)
        return BlockState(self.state[block])

    # ------------------------------------------------------------------ keys and children
    def _key(self, block: int, key: bytes) -> None:
        self.key[block] = key
        self.lookup[key] = block
        pk = self.parents.get(key)
        if pk is not None:
            self.parent[block] = pk
            self._add_child(pk, block)

    def _unkey(self, block: int) -> bytes:
        k = self.key[block]
        del self.lookup[k]
        self.key[block] = None
        pk = self.parent[block]
        if pk is not None:
            self.parent[block] = None
            self._unchild(pk, block)
        return k

    def children(self, pk: bytes) -> list[int | None]:
        """The children of key ``pk`` in this tier: blocks, and None for each a copy brings."""
        c = self.kids.get(pk, _NONE)
        if c is _NONE:
            return []
        return list(c) if type(c) is list else [c]

    def _add_child(self, pk: bytes, child: int | None) -> None:
        kids = self.kids
        c = kids.get(pk, _NONE)
        if c is _NONE:
            kids[pk] = child
        elif type(c) is list:
            c.append(child)
        else:
            kids[pk] = [c, child]

    def _unchild(self, pk: bytes, child: int | None) -> None:
        kids = self.kids
        c = kids[pk]
        if type(c) is not list:
            del kids[pk]
        else:
            c.remove(child)
            if len(c) == 1:
                kids[pk] = c[0]

    def expect(self, keys: list[bytes]) -> list[bytes]:
        """A copy brings ``keys`` to this tier: their parents here wait for them as for keyed
        children. Returns those parents, for ``unexpect`` once it is done."""
        get = self.parents.get
        out = []
        for k in keys:
            pk = get(k)
            if pk is not None:
                self._add_child(pk, None)
                out.append(pk)
        return out

    def unexpect(self, parents: list[bytes]) -> None:
        for pk in parents:
            self._unchild(pk, None)

    def _evict_leaves(self, n: int, evicted: list[tuple[int, bytes]] | None) -> list[int]:
        """Dequeue and unkey ``n`` CACHED blocks, leaves first (``n <= len(self.evictable)``);
        each ``(block, key)`` is appended to ``evicted``. The loop over each dequeued batch is C
        (``fastkv.native._pool``); ``_evict_leaves_reference`` defines it."""
        if type(self.lookup) is not dict:  # an observed map (fastkv.cache.residency): its methods report
            return self._evict_leaves_reference(n, evicted)
        queue = self.evictable
        out: list[int] = []
        skips = 0
        while len(out) < n:
            skips, passed, forced = _pool.evict_batch(queue.popleft_many(n - len(out)), self.key, self.lookup,
                                                      self.parent, self.kids, out, evicted, queue, skips)
            self.passed_over += passed
            self.forced_evictions += forced
        return out

    def _evict_leaves_reference(self, n: int, evicted: list[tuple[int, bytes]] | None) -> list[int]:
        queue, kids, key, lookup, parent = self.evictable, self.kids, self.key, self.lookup, self.parent
        out: list[int] = []
        append = out.append
        report = evicted.append if evicted is not None else None
        skips = 0
        while len(out) < n:
            for b in queue.popleft_many(n - len(out)):
                k = key[b]
                if k in kids:
                    if skips <= len(queue):
                        queue.requeue(b)  # behind its children: they go first
                        skips += 1
                        self.passed_over += 1
                        continue
                    self.forced_evictions += 1
                skips = 0
                del lookup[k]  # _unkey, inline: the hot path of allocation
                key[b] = None
                pk = parent[b]
                if pk is not None:
                    parent[b] = None
                    self._unchild(pk, b)
                append(b)
                if evicted is not None:
                    report((b, k))
        return out

    # ------------------------------------------------------------------ handing out
    def take(self, evicted: list[tuple[int, bytes]] | None = None) -> int | None:
        """Hand out a block with refcount 1: a FREE one, else evict the next CACHED victim.

        An evicted block's ``(block, key)`` is appended to ``evicted``. Returns None when every
        block is ALLOCATED or IN_FLIGHT.
        """
        if self.free:
            block = self.free.pop()
        else:
            block = self.evictable.popleft()
            if block is None:
                return None
            k = self.key[block]
            if k in self.kids:  # a parent first in line: the slow path finds a leaf
                self.evictable.requeue(block)
                self.passed_over += 1
                block = self._evict_leaves(1, evicted)[0]
            else:
                self._unkey(block)
                if evicted is not None:
                    evicted.append((block, k))
        self.state[block] = _ALLOCATED
        self.ref[block] = 1
        self.num_allocated += 1
        return block

    def take_many(self, n: int, evicted: list[tuple[int, bytes]] | None = None) -> list[int]:
        """``n`` blocks as by ``take``, in one pass (the hot path of allocation)."""
        free = self.free
        nf = len(free)
        if n > nf + len(self.evictable):
            raise ValueError(f"{self.tier} pool: {n} blocks asked, {self.num_available} available")
        if n <= nf:
            blocks = free[nf - n:]
            del free[nf - n:]
            blocks.reverse()
        else:
            blocks = free[::-1]
            free.clear()
            blocks += self._evict_leaves(n - nf, evicted)
        state, ref = self.state, self.ref
        for b in blocks:
            state[b] = _ALLOCATED
            ref[b] = 1
        self.num_allocated += n
        return blocks

    def take_pinned(self, evicted: list[tuple[int, bytes]] | None = None) -> int | None:
        """A block for a copy to write into: IN_FLIGHT with refcount 0. None when none."""
        block = self.take(evicted)
        if block is not None:
            self.ref[block] = 0
            self.num_allocated -= 1
            self.num_in_flight += 1
            self.state[block] = _IN_FLIGHT
            self.pins[block] = 1
        return block

    def incref(self, block: int) -> None:
        """One more holder of a keyed block (a prefix hit) or of an ALLOCATED one."""
        st = self.state[block]
        if st == _CACHED:
            self.evictable.remove(block)
            self.state[block] = _ALLOCATED
            self.num_allocated += 1
        elif st == _FREE:
            raise ValueError(f"{self.tier} block {block} is FREE: take() it, do not incref it")
        self.ref[block] += 1

    def incref_many(self, blocks: list[int]) -> None:
        """``incref`` each block, inline (a prefix hit's whole run: one call, not one per block)."""
        state, ref, queued = self.state, self.ref, self.evictable
        for b in blocks:
            st = state[b]
            if st == _CACHED:
                queued.remove(b)
                state[b] = _ALLOCATED
                self.num_allocated += 1
            elif st == _FREE:
                raise ValueError(f"{self.tier} block {b} is FREE: take() it, do not incref it")
            ref[b] += 1

    def hold_keys(self, keys: list[bytes], skip: set[bytes]) -> tuple[list[int], list[bytes]]:
        """``incref`` the block of each key in ``keys`` (not in ``skip``) this tier has, inline
        (a write-through's hold on its chain: one call per plan, not one per block). Returns
        the blocks held, in ``keys``' order, and the keys this tier does not have."""
        lookup, state, ref, queued = self.lookup, self.state, self.ref, self.evictable
        held: list[int] = []
        missing: list[bytes] = []
        hold, miss = held.append, missing.append
        for k in keys:
            if k in skip:
                continue
            b = lookup.get(k)
            if b is None:
                miss(k)
                continue
            if state[b] == _CACHED:
                queued.remove(b)
                state[b] = _ALLOCATED
                self.num_allocated += 1
            ref[b] += 1
            hold(b)
        return held, missing

    def release(self, block: int, keep: bool = True) -> None:
        """Drop one reference. At zero: CACHED if keyed (and ``keep``), else FREE; an IN_FLIGHT
        block waits for its copies (``unpin``)."""
        r = self.ref[block]
        if r <= 0:
            raise ValueError(f"{self.tier} block {block} released with refcount {r} (double free?)")
        r -= 1
        self.ref[block] = r
        if r == 0 and self.state[block] == _ALLOCATED:
            self.num_allocated -= 1
            k = self.key[block]
            if k is not None and keep:
                self.state[block] = _CACHED
                self.evictable.append(block)
            else:
                if k is not None:
                    self._unkey(block)
                    self.evictable.forget(block)
                self.state[block] = _FREE
                self.free.append(block)
        elif r == 0 and not keep and self.key[block] is not None:
            self.drop_key(block)

    # ------------------------------------------------------------------ copies
    def pin(self, block: int) -> None:
        """A copy starts reading or writing ``block``."""
        self._check_id(block)
        st = self.state[block]
        if st == _FREE:
            raise ValueError(f"{self.tier} block {block} is FREE: nothing to copy")
        if st == _CACHED:
            self.evictable.remove(block)
        if st != _IN_FLIGHT:
            if st == _ALLOCATED:
                self.num_allocated -= 1
            self.num_in_flight += 1
            self.state[block] = _IN_FLIGHT
        self.pins[block] += 1

    def unpin(self, block: int) -> None:
        """A copy of ``block`` finished (either way)."""
        self._check_id(block)
        p = self.pins[block]
        if p <= 0 or self.state[block] != _IN_FLIGHT:
            raise ValueError(f"{self.tier} block {block} is not in flight")
        self.pins[block] = p - 1
        if p > 1:
            return
        self.num_in_flight -= 1
        if self.ref[block] > 0:
            self.state[block] = _ALLOCATED
            self.num_allocated += 1
        elif self.key[block] is not None:
            self.state[block] = _CACHED
            self.evictable.append(block)
        else:
            self.state[block] = _FREE
            self.free.append(block)

    # ------------------------------------------------------------------ keys
    def set_key(self, block: int, key: bytes) -> bool:
        """Declare ``block``'s bytes valid for ``key``. False (and no change) when another block
        of this tier already holds ``key``: the caller's block stays unkeyed (a duplicate)."""
        self._check_id(block)
        st = self.state[block]
        if st == _FREE or st == _CACHED:
            raise ValueError(f"{self.tier} block {block} is {BlockState(st).name}: only a held block gets a key")
        if self.key[block] is not None:
            raise ValueError(f"{self.tier} block {block} already has a key")
        if key in self.lookup:
            return False
        self._key(block, key)
        return True

    def insert_many(self, blocks: list[int], keys: list[bytes], parents: list[bytes | None] | None = None) -> list[int]:
        """``set_key`` for held, unkeyed blocks (after compute). A key another block already has
        moves to the held block when that other one is only CACHED (same bytes, and the held
        copy is the one its request's children will follow); when it is held too, the new block
        stays an unkeyed duplicate. ``parents``: each key's parent key (None under the root), as
        ``self.parents`` has them, when the caller knows them (a request's own chain: no probe
        per block). Returns the indices (into ``blocks``) of the duplicates.

        The loop is C (``fastkv.native._pool``: every computed block passes through it);
        ``_insert_many_reference`` defines it."""
        if parents is None:
            parents = [self.parents.get(k) for k in keys]
        if type(self.lookup) is not dict:  # an observed map (fastkv.cache.residency): its methods report
            return self._insert_many_reference(blocks, keys, parents)
        return _pool.insert_keys(self.lookup, self.key, self.state, self.parent, self.kids, list(blocks), list(keys),
                                 list(parents), _CACHED, self.drop_key)

    def _insert_many_reference(self, blocks: list[int], keys: list[bytes], parents: list[bytes | None]) -> list[int]:
        setdefault, key, state = self.lookup.setdefault, self.key, self.state
        parent = self.parent
        dups = []
        for i, (b, k, pk) in enumerate(zip(blocks, keys, parents, strict=True)):
            holder = setdefault(k, b)  # one dict probe: inserted, or another block has k
            if holder is not b:
                if state[holder] != _CACHED:
                    dups.append(i)
                    continue
                self.drop_key(holder)  # it becomes FREE
                self.lookup[k] = b
            key[b] = k
            if pk is not None:
                parent[b] = pk
                self._add_child(pk, b)
        return dups

    def release_many(self, blocks: list[int], keep: bool = True) -> None:
        """``release`` each block in order (callers pass a table last to first). The common case,
        a keyed block going CACHED, is queued in one ``extend`` (no call per block). The loop is
        C (``fastkv.native._pool``); ``_release_many_reference`` defines it."""
        cached: list[int] = []
        try:
            _pool.release_blocks(self.ref, self.state, self.key, list(blocks), keep, cached, _ALLOCATED, _CACHED,
                                 self.release)
        finally:
            self.evictable.extend(cached)
            self.num_allocated -= len(cached)

    def _release_many_reference(self, blocks: list[int], keep: bool = True) -> None:
        ref, state, key = self.ref, self.state, self.key
        cached: list[int] = []
        queue = cached.append
        try:
            for b in blocks:
                r = ref[b] - 1
                if r > 0:
                    ref[b] = r
                elif r == 0 and keep and state[b] == _ALLOCATED and key[b] is not None:
                    ref[b] = 0
                    state[b] = _CACHED
                    queue(b)
                else:
                    self.release(b, keep)  # never queues a block: the order above holds
        finally:
            self.evictable.extend(cached)
            self.num_allocated -= len(cached)

    def drop_key(self, block: int) -> bytes | None:
        """Forget ``block``'s key (its bytes are stale or unwanted). A CACHED block becomes FREE."""
        self._check_id(block)
        k = self.key[block]
        if k is None:
            return None
        self._unkey(block)
        if self.state[block] == _CACHED:
            self.evictable.remove(block)
            self.state[block] = _FREE
            self.free.append(block)
        self.evictable.forget(block)
        return k

    def evict(self, block: int) -> bytes:
        """Evict a CACHED block now (it becomes FREE). Refuses IN_FLIGHT and held blocks."""
        self._check_id(block)
        st = self.state[block]
        if st != _CACHED:
            raise ValueError(f"{self.tier} block {block} is {BlockState(st).name}: only a CACHED block can be evicted")
        k = self.drop_key(block)
        assert k is not None, f"{self.tier} block {block}: CACHED without a key"
        return k

    def touch(self, block: int) -> None:
        """An access to a CACHED block that does not hold it (no-op for held or in-flight blocks)."""
        if self.state[block] == _CACHED:
            self.evictable.touch(block)

    def clear(self) -> list[bytes]:
        """Forget every key (weight update). Every block must be FREE or CACHED."""
        if self.num_allocated or self.num_in_flight:
            raise ValueError(f"{self.tier} pool clear with {self.num_allocated} allocated and "
                             f"{self.num_in_flight} in-flight blocks")
        dropped = list(self.lookup)
        while (block := self.evictable.popleft()) is not None:
            self.key[block] = None
            if (pk := self.parent[block]) is not None:
                self._unchild(pk, block)  # what stays listed is what copies bring
                self.parent[block] = None
            self.state[block] = _FREE
            self.free.append(block)
        self.lookup.clear()
        return dropped

    # ------------------------------------------------------------------ checks
    def check_integrity(self) -> None:
        self.evictable.check_integrity()
        counts = [0, 0, 0, 0]
        for b in range(self.capacity):
            st, r, p, k = self.state[b], self.ref[b], self.pins[b], self.key[b]
            counts[st] += 1
            assert r >= 0 and p >= 0, f"{self.tier} block {b}: negative refcount {r} or pins {p}"
            queued = b in self.evictable
            assert queued == (st == _CACHED), f"{self.tier} block {b}: state {st} but queued = {queued}"
            assert (p > 0) == (st == _IN_FLIGHT), f"{self.tier} block {b}: state {st} with {p} pins"
            if st == _FREE:
                assert r == 0 and k is None, f"{self.tier} block {b}: FREE with refcount {r} or key"
            elif st == _ALLOCATED:
                assert r > 0, f"{self.tier} block {b}: ALLOCATED with refcount 0"
            elif st == _CACHED:
                assert r == 0 and k is not None, f"{self.tier} block {b}: CACHED needs refcount 0 and a key"
            if k is not None:
                assert self.lookup.get(k) == b, f"{self.tier} block {b}: key not in lookup"
        free_set = set(self.free)
        assert len(free_set) == len(self.free), f"{self.tier}: a block is twice on the free stack"
        assert all(self.state[b] == _FREE for b in free_set), f"{self.tier}: non-FREE block on the free stack"
        assert counts[_FREE] == len(self.free), f"{self.tier}: {counts[_FREE]} FREE blocks, free stack {len(self.free)}"
        assert counts[_CACHED] == len(self.evictable)
        assert counts[_ALLOCATED] == self.num_allocated, f"{self.tier}: allocated {self.num_allocated} != {counts}"
        assert counts[_IN_FLIGHT] == self.num_in_flight, f"{self.tier}: in flight {self.num_in_flight} != {counts}"
        assert sum(counts) == self.capacity
        assert len(self.lookup) == sum(1 for k in self.key if k is not None), f"{self.tier}: stale lookup entries"
        kids: dict[bytes, list[int]] = {}
        for b, pk in enumerate(self.parent):
            if pk is not None:
                assert self.key[b] is not None, f"{self.tier} block {b}: a parent key but no key"
                kids.setdefault(pk, []).append(b)
        assert all(type(c) is not list or len(c) > 1 for c in self.kids.values()), \
            f"{self.tier}: a parent's only child kept in a list"
        listed = {pk: sorted(b for b in self.children(pk) if b is not None) for pk in self.kids}
        # the Nones are children a copy brings (checked against the copies by the cache's check)
        assert {pk: c for pk, c in listed.items() if c} == kids, f"{self.tier}: children listed {listed} != {kids}"

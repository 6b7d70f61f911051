"""KV cache groups: per group of layers, a device block pool and each request's block table.

A hybrid model's layers differ in what they read (``fastkv.config.KVGroup``): a full-attention
layer every earlier position, a sliding-window layer only the last ``window``. Each group has
its own ``BlockPool`` (a block is a slot in its layers' tensors only) and a request has one
table per group, indexed by block number (one block size: block i covers the same tokens in
every group, so a block's key is the request's chained key i in every group). A sliding
group's table has holes: after each step (``computed``) it lets go of the blocks wholly before
the window the next query reads, CACHED if keyed (another request with this prefix may still
hit them) and FREE otherwise, so between steps it holds at most ceil(w / bs) + 1 blocks per
request, and ``KVGroup.max_blocks(bs, chunk)`` while a step computes a chunk.

A prefix of n blocks is a hit when every group can serve it: a full group holds blocks 0..n-1,
a sliding group the blocks the query at position n * bs reads. Full groups chain their keys
(leaves first, as ``BlockPool`` keeps them); a sliding group's blocks have no parents: it
needs the tail of a prefix, not its head, and its pool evicts in plain LRU order.

Sizing: admission reserves, per group, the blocks a request can need before it is asked
again: a full group the rest of its prompt, a sliding group its bound for the request's chunk
(``set_chunk`` lowers it once prefill is over). ``slots`` takes them as the steps need them.
A block a sliding group lets go of is room again only if no other request holds it, so a
request sharing its window's blocks may find its reservation short later: ``slots`` then
takes what is free, or answers None (the caller preempts, as for a full group's growth).
A request may be offloaded to each group's host pool and restored (``fastkv.cache.group_tiers``);
storage copies of groups are not built.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fastkv.cache.pool import BlockPool, BlockState
from fastkv.config import KVGroup, KVLayout, cdiv


@dataclass
class _Held:
    """One request in one group: its table (block number -> block) and its reservation."""

    table: dict[int, int] = field(default_factory=dict)
    reserved: int = 0
    keyed: int = 0  # blocks below this number got their keys (or slid out before)


@dataclass
class _Request:
    num_tokens: int
    chunk: int
    num_computed: int = 0
    state: str = "running"  # or offloading, offloaded, restoring (fastkv.cache.group_tiers)


class GroupPool:
    """One group's pool and the requests' tables in it."""

    def __init__(self, index: int, group: KVGroup, block_size: int, capacity: int, eviction: str,
                 host_capacity: int = 0) -> None:
        self.index, self.group, self.block_size = index, group, block_size
        self.pool = BlockPool(f"group {index} device", capacity, eviction)
        self.host = BlockPool(f"group {index} host", host_capacity, eviction)
        self.held: dict[object, _Held] = {}
        self.offloaded: dict[object, dict[int, int]] = {}  # request -> its host table (block number -> host block)
        self.reserved = 0  # every request's reservation
        self.hit_blocks = 0  # blocks admissions found here: the group's hits

    def needed(self, first: int, end: int) -> range:
        """Block numbers a step over positions [first, end) reads or writes in this group."""
        return range(self.group.first_needed(first, self.block_size), cdiv(end, self.block_size))

    def serves(self, keys: Sequence[bytes], n: int) -> bool:
        """It holds every block of a hit of ``n`` blocks that the next query reads."""
        lookup = self.pool.lookup
        return all(keys[i] in lookup for i in self.needed(n * self.block_size, n * self.block_size))

    @property
    def available(self) -> int:
        return self.pool.num_available - self.reserved

    def reserve(self, h: _Held, n: int) -> None:
        self.reserved += n - h.reserved
        h.reserved = n


class GroupedCache:
    """Block tables per KV cache group (module docstring). ``capacities``: device blocks per
    group; ``host_capacities``: host blocks per group, for offload (``fastkv.cache.group_tiers``)."""

    def __init__(self, layout: KVLayout, capacities: Sequence[int], eviction: str = "lru",
                 host_capacities: Sequence[int] | None = None) -> None:
        groups = layout.groups
        hosts = list(host_capacities) if host_capacities is not None else [0] * len(groups)
        if len(capacities) != len(groups) or len(hosts) != len(groups):
            raise ValueError(f"capacities and host_capacities must name each of the {len(groups)} groups, "
                             f"got {len(capacities)} and {len(hosts)}")
        self.layout, self.block_size = layout, layout.block_size
        self.groups = [GroupPool(i, g, layout.block_size, c, eviction, h)
                       for i, (g, c, h) in enumerate(zip(groups, capacities, hosts, strict=True))]
        self._reqs: dict[object, _Request] = {}
        self.next_plan = 1

    # ------------------------------------------------------------------ admission
    def match(self, keys: Sequence[bytes], num_tokens: int) -> int:
        """The most leading blocks every group serves (the last token is always computed)."""
        n = min(len(keys), (num_tokens - 1) // self.block_size)
        for gp in self.groups:
            if not gp.group.window:  # a full group's run from the root
                lookup = gp.pool.lookup
                i = 0
                while i < n and keys[i] in lookup:
                    i += 1
                n = i
        # a sliding group's answer is not monotone in n: the blocks before its window may be gone
        while n and not all(gp.serves(keys, n) for gp in self.groups if gp.group.window):
            n -= 1
        return n

    def reservation(self, gp: GroupPool, held: int, num_tokens: int, chunk: int) -> int:
        """What ``gp`` reserves for a request holding ``held`` blocks: a full group the rest of
        its first ``num_tokens`` tokens, a sliding group up to its bound for ``chunk``."""
        bound = gp.group.max_blocks(self.block_size, chunk)
        if bound is None:
            return max(0, cdiv(num_tokens, self.block_size) - held)
        return max(0, bound - held)

    def allocate(self, request_id: object, keys: Sequence[bytes], num_tokens: int, chunk: int) -> int | None:
        """Admit a request of ``num_tokens`` tokens (``keys``: its full blocks' chained keys) that
        computes up to ``chunk`` tokens a step. Returns the tokens its prefix hit serves, or None
        (nothing changed) when a group lacks room for its reservation."""
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already allocated")
        if num_tokens <= 0 or chunk <= 0:
            raise ValueError(f"request {request_id!r}: num_tokens and chunk must be > 0, got {num_tokens}, {chunk}")
        n = self.match(keys, num_tokens)
        bs = self.block_size
        hits = []
        for gp in self.groups:
            blocks = [gp.pool.lookup[keys[i]] for i in gp.needed(n * bs, n * bs)]
            cached = sum(1 for b in blocks if gp.pool.state[b] == BlockState.CACHED)
            need = self.reservation(gp, len(blocks), num_tokens, chunk)
            if gp.available - cached < need:
                return None
            hits.append((gp, blocks, need))
        first = n * bs
        for gp, blocks, need in hits:
            gp.pool.incref_many(blocks)
            h = _Held({i: b for i, b in zip(gp.needed(first, first), blocks, strict=True)}, keyed=n)
            gp.held[request_id] = h
            gp.reserve(h, need)
            gp.hit_blocks += len(blocks)
        self._reqs[request_id] = _Request(num_tokens, chunk, first)
        return first

    def set_chunk(self, request_id: object, chunk: int) -> None:
        """The request computes at most ``chunk`` tokens a step from now on (1: it decodes)."""
        req = self.record(request_id, "running")
        if not 0 < chunk <= req.chunk:
            raise ValueError(f"request {request_id!r}: chunk may only go down, from {req.chunk} to > 0, got {chunk!r}")
        req.chunk = chunk
        for gp in self.groups:
            if gp.group.window:
                h = gp.held[request_id]
                gp.reserve(h, min(h.reserved, self.reservation(gp, len(h.table), req.num_tokens, chunk)))

    # ------------------------------------------------------------------ steps
    def slots(self, request_id: object, start: int, count: int) -> list[np.ndarray] | None:
        """Blocks for a step computing positions [start, start + count): per group, its table up
        to the last of them (-1 where it holds nothing). None (nothing changed) when a group
        lacks blocks beyond the request's reservation."""
        req = self.record(request_id, "running")
        if start != req.num_computed or not 0 < count <= req.chunk:
            raise ValueError(f"request {request_id!r}: a step over [{start}, {start + count}) after "
                             f"{req.num_computed} computed tokens (chunk {req.chunk})")
        missing = []
        for gp in self.groups:
            h = gp.held[request_id]
            need = gp.needed(start, start + count)
            # a full group's table is dense from block 0: only its tail can be missing
            new = [i for i in need if i not in h.table] if gp.group.window else range(len(h.table), need.stop)
            if gp.available + h.reserved < len(new):
                return None
            missing.append((gp, h, new))
        for gp, h, new in missing:
            if not new:
                continue
            own = min(len(new), h.reserved)
            gp.reserve(h, h.reserved - own)
            h.table.update(zip(new, gp.pool.take_many(len(new)), strict=True))
        req.num_tokens = max(req.num_tokens, start + count)
        return self.tables(request_id)

    def computed(self, request_id: object, num_computed: int, keys: Sequence[bytes]) -> None:
        """The first ``num_computed`` tokens' KV is on the device (``keys``: the request's keys so
        far): full blocks get their keys, and each sliding group lets go of what slid out."""
        req = self.record(request_id, "running")
        if not req.num_computed <= num_computed <= req.num_tokens:
            raise ValueError(f"request {request_id!r}: num_computed {num_computed} outside "
                             f"[{req.num_computed}, {req.num_tokens}]")
        req.num_computed = num_computed
        full = min(num_computed // self.block_size, len(keys))
        for gp in self.groups:
            h = gp.held[request_id]
            todo = [i for i in range(h.keyed, full) if i in h.table]
            if todo:
                parents = [None] * len(todo) if gp.group.window else [keys[i - 1] if i else None for i in todo]
                gp.pool.insert_many([h.table[i] for i in todo], [keys[i] for i in todo], parents)
            h.keyed = max(h.keyed, full)
            if gp.group.window:
                first = gp.group.first_needed(num_computed, self.block_size)
                gone = sorted(i for i in h.table if i < first)
                if gone:
                    blocks = [h.table.pop(i) for i in reversed(gone)]
                    gp.pool.release_many(blocks)
                    # only what no other request holds is room again: a shared block stays taken
                    room = sum(1 for b in blocks if gp.pool.ref[b] == 0)
                    gp.reserve(h, min(h.reserved + room, self.reservation(gp, len(h.table), req.num_tokens, req.chunk)))

    def free(self, request_id: object, cache: bool = True) -> None:
        """The request is done: its keyed blocks stay CACHED (unless ``cache`` is False)."""
        self.record(request_id, "running", "offloaded")
        del self._reqs[request_id]
        for gp in self.groups:
            h = gp.held.pop(request_id)
            gp.reserve(h, 0)
            gp.pool.release_many([h.table[i] for i in sorted(h.table, reverse=True)], keep=cache)
            host = gp.offloaded.pop(request_id, None)
            if host:
                gp.host.release_many(list(host.values()), keep=False)

    # ------------------------------------------------------------------ queries
    def record(self, request_id: object, *states: str) -> _Request:
        """The request's record, refused unless it is in one of ``states`` (any, if none)."""
        req = self._reqs.get(request_id)
        if req is None:
            raise ValueError(f"unknown request {request_id!r}")
        if states and req.state not in states:
            raise ValueError(f"request {request_id!r} is {req.state}, not {' or '.join(states)}")
        return req

    def request_ids(self) -> list[object]:
        return list(self._reqs)

    def tables(self, request_id: object) -> list[np.ndarray]:
        """Per group, the request's table indexed by block number (-1: a hole)."""
        self.record(request_id)
        out = []
        for gp in self.groups:
            t = gp.held[request_id].table
            if gp.group.window:
                arr = np.full(max(t) + 1 if t else 0, -1, dtype=np.int32)
                arr[np.fromiter(t, np.int64, len(t))] = np.fromiter(t.values(), np.int32, len(t))
            else:  # dense, filled in block order
                arr = np.fromiter(t.values(), np.int32, len(t))
            out.append(arr)
        return out

    def held_blocks(self, request_id: object) -> list[int]:
        """Blocks the request holds, per group."""
        self.record(request_id)
        return [len(gp.held[request_id].table) for gp in self.groups]

    def check_integrity(self) -> None:
        """Per group: the pool's invariants, each table's blocks held once per holder, the
        reservations within reach, and a sliding table inside its window and its bound."""
        bs = self.block_size
        for gp in self.groups:
            pool = gp.pool
            pool.check_integrity()
            gp.host.check_integrity()
            host_holders = [0] * gp.host.capacity
            for rid, t in gp.offloaded.items():
                assert self._reqs[rid].state != "running", f"group {gp.index}: running request {rid!r} has host blocks"
                for b in t.values():
                    host_holders[b] += 1
            assert gp.host.ref == host_holders, f"group {gp.index}: host refcounts are not the offloaded tables'"
            holders = [0] * pool.capacity
            for rid, h in gp.held.items():
                req = self._reqs[rid]
                for b in h.table.values():
                    holders[b] += 1
                if gp.group.window and req.state == "running":
                    first = gp.group.first_needed(req.num_computed, bs)
                    assert all(i >= first for i in h.table), \
                        f"group {gp.index}: request {rid!r} holds blocks before {first}: {sorted(h.table)}"
                    assert len(h.table) <= gp.group.max_blocks(bs, req.chunk), \
                        f"group {gp.index}: request {rid!r} holds {len(h.table)} blocks, over its bound"
            for b in range(pool.capacity):
                assert pool.ref[b] == holders[b], f"group {gp.index} block {b}: refcount {pool.ref[b]}, " \
                                                  f"{holders[b]} tables hold it"
            assert gp.reserved == sum(h.reserved for h in gp.held.values())
            assert gp.reserved <= pool.num_available, f"group {gp.index}: {gp.reserved} reserved, " \
                                                      f"{pool.num_available} available"
        assert all(set(gp.held) == set(self._reqs) for gp in self.groups)


def split_device_tier(layout: KVLayout, device_bytes: int, num_tokens: int, chunk: int, prefills: int = 1) -> list[int]:
    """Blocks per group for a device tier of ``device_bytes``, in the proportions requests of
    ``num_tokens`` tokens need them: a full group their every block, a sliding group its bound
    while decoding, and the bound for ``chunk`` tokens for ``prefills`` requests prefilling at once."""
    bs = layout.block_size
    if device_bytes <= 0 or num_tokens <= 0 or chunk <= 0 or prefills < 0:
        raise ValueError(f"device_bytes, num_tokens and chunk must be > 0 and prefills >= 0, got "
                         f"{device_bytes}, {num_tokens}, {chunk}, {prefills}")
    groups = layout.groups
    per_req = [g.max_blocks(bs) or cdiv(num_tokens, bs) for g in groups]
    extra = [(g.max_blocks(bs, chunk) - g.max_blocks(bs)) * prefills if g.window else 0 for g in groups]
    sizes = [layout.group_block_bytes(g) for g in groups]
    fixed = sum(e * s for e, s in zip(extra, sizes, strict=True))
    requests = max(0, device_bytes - fixed) / sum(n * s for n, s in zip(per_req, sizes, strict=True))
    caps = [-int(-requests * n // 1) + e for n, e in zip(per_req, extra, strict=True)]  # rounded up
    full = next((i for i, g in enumerate(groups) if not g.window), None)
    if full is not None:  # a full group takes what is left: it bounds how many requests fit
        caps[full] = 0
        caps[full] = (device_bytes - sum(c * s for c, s in zip(caps, sizes, strict=True))) // sizes[full]
    if min(caps) <= 0:
        raise ValueError(f"a device tier of {device_bytes} bytes cannot hold one request of {num_tokens} tokens "
                         f"in every group of {layout.describe()}")
    return caps

"""KV cache groups (``GroupedCache``) against a cache-free reference, after every step.

The reference: the KV of position p of a request is a pure function of its tokens 0..p (what a
model computes without a cache). Every step writes each computed position's value through the
request's table of every group, then reads back every position each layer kind attends to
(a full layer 0..p, a sliding layer p - w + 1..p) through the tables and asserts it is the
reference's; the next token depends on what was read. A block released too early, handed to
another request while still needed, or served as a hit for other tokens reads a wrong value.
Small pools make requests evict each other's cached blocks and share prefixes longer than a
window. Requests are offloaded to each group's host pool and restored later (the copies done
here, at once, between other requests' steps): each group must move exactly the blocks it
holds, and the restored request read the reference again. After every step:
``check_integrity()`` and the bound ceil(w / bs) + 1 of a decoding request's sliding tables."""
from __future__ import annotations

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastkv.cache import group_tiers
from fastkv.cache.groups import GroupedCache
from fastkv.cache.keys import as_tokens, block_keys
from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout, cdiv

BS = 4
LAYOUT = KVLayout(4, 1, BS, 8, windows=(6, 0, 6, 0))  # a sliding group (w = 6) and a full one
CAPACITY = (10, 24)
HOST = (6, 20)
ROOT = b"r" * 32
PREFIXES = [list(range(1, 14)), [7] * 9, list(range(40, 51))]
VOCAB = 97


def value(tokens: list[int], p: int) -> int:
    """The reference KV of position p: a function of the whole prefix 0..p."""
    h = 17
    for t in tokens[:p + 1]:
        h = (h * 1000003 + t + 1) % (1 << 61)
    return h


class GroupsMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.cache = GroupedCache(LAYOUT, CAPACITY, host_capacities=HOST)
        self.store = [np.zeros((c, BS), dtype=np.int64) for c in CAPACITY]
        self.host = [np.zeros((c, BS), dtype=np.int64) for c in HOST]
        self.offloaded: dict[int, dict] = {}
        self.reqs: dict[int, dict] = {}
        self.next_id = 0
        self.hit_tokens = 0

    def keys(self, tokens):
        return block_keys(as_tokens(tokens), BS, ROOT)

    def read(self, rid, tokens, p, cached_only=False):
        """Assert every position query p attends to, in each group, reads the reference
        (``cached_only``: those before p, all a query not yet computed finds in the cache)."""
        tables = self.cache.tables(rid)
        for gp, table, store in zip(self.cache.groups, tables, self.store, strict=True):
            w = gp.group.window
            for q in range(max(0, p - w + 1) if w else 0, p if cached_only else p + 1):
                b = table[q // BS]
                assert b >= 0, f"group {gp.index}: position {q} (query {p}) has no block"
                assert store[b, q % BS] == value(tokens, q), \
                    f"group {gp.index}: position {q} (query {p}) reads block {b}'s stale or foreign KV"

    @rule(prefix=st.sampled_from(range(len(PREFIXES))), cut=st.integers(2, 13), tail=st.lists(st.integers(0, 9),
          max_size=6), chunk=st.sampled_from([1, 3, 8]), out=st.integers(1, 10))
    def add(self, prefix, cut, tail, chunk, out):
        tokens = PREFIXES[prefix][:cut] + tail
        rid = self.next_id
        self.next_id += 1
        got = self.cache.allocate(rid, self.keys(tokens), len(tokens), chunk)
        if got is None:
            return
        assert got % BS == 0 and got <= len(tokens) - 1
        self.hit_tokens += got
        self.reqs[rid] = dict(tokens=tokens, prompt=len(tokens), computed=got, chunk=chunk, out=out)
        if got:  # what a hit serves the query at ``got`` is exactly what this request's own compute would be
            self.read(rid, tokens, got, cached_only=True)

    def copy(self, copies, kind):
        for gc in copies:
            assert gc.plan.kind is kind
            src, dst = (self.store, self.host) if kind is CopyKind.SWAP_OUT else (self.host, self.store)
            dst[gc.group][gc.plan.dst] = src[gc.group][gc.plan.src]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), ok=st.booleans())
    def offload(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        tables = [dict(enumerate(t)) for t in self.cache.tables(rid)]
        copies = group_tiers.offload(self.cache, rid)
        if copies is None:
            return
        for gc, table in zip(copies, tables, strict=True):  # exactly what the group holds, in block order
            assert list(gc.plan.src) == [b for _, b in sorted(table.items()) if b >= 0]
        if ok:
            self.copy(copies, CopyKind.SWAP_OUT)
        group_tiers.offloaded(self.cache, rid, ok)
        if ok:
            self.offloaded[rid] = self.reqs.pop(rid)

    @precondition(lambda self: self.offloaded)
    @rule(data=st.data(), ok=st.booleans())
    def restore(self, data, ok):
        rid = data.draw(st.sampled_from(sorted(self.offloaded)))
        copies = group_tiers.restore(self.cache, rid)
        if copies is None:
            return
        if ok:
            self.copy(copies, CopyKind.SWAP_IN)
        group_tiers.restored(self.cache, rid, ok)
        r = self.offloaded.pop(rid)
        if ok:  # resumed exactly where it stopped: its next query reads the reference in every group
            self.reqs[rid] = r
            self.read(rid, r["tokens"], r["computed"], cached_only=True)

    @precondition(lambda self: self.offloaded)
    @rule(data=st.data())
    def drop_offloaded(self, data):
        rid = data.draw(st.sampled_from(sorted(self.offloaded)))
        self.cache.free(rid)
        del self.offloaded[rid]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def step(self, data):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        r = self.reqs[rid]
        start, tokens = r["computed"], r["tokens"]
        count = min(r["chunk"], len(tokens) - start)
        if self.cache.slots(rid, start, count) is None:  # the full group is out of room: preempt (recompute)
            self.cache.free(rid)
            del self.reqs[rid]
            return
        tables = self.cache.tables(rid)
        for p in range(start, start + count):
            for table, store in zip(tables, self.store, strict=True):
                store[table[p // BS], p % BS] = value(tokens, p)
        for p in range(start, start + count):
            self.read(rid, tokens, p)
        r["computed"] = start + count
        self.cache.computed(rid, r["computed"], self.keys(tokens[:r["computed"]]))
        if r["computed"] == len(tokens):  # sampled: the next token, from the last position's KV
            tokens.append(value(tokens, len(tokens) - 1) % VOCAB)
            if r["chunk"] != 1:  # decoding from now on
                self.cache.set_chunk(rid, 1)
                r["chunk"] = 1
        if len(tokens) - r["prompt"] >= r["out"]:
            self.cache.free(rid, cache=data.draw(st.booleans()))
            del self.reqs[rid]

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), cache=st.booleans())
    def abort(self, data, cache):
        rid = data.draw(st.sampled_from(sorted(self.reqs)))
        self.cache.free(rid, cache=cache)
        del self.reqs[rid]

    @invariant()
    def integrity(self):
        self.cache.check_integrity()
        sliding = self.cache.groups[0]
        assert sliding.group.window == 6
        for rid, r in self.reqs.items():
            held = self.cache.held_blocks(rid)
            if r["chunk"] == 1:  # decoding: the bound of the issue, ceil(w / bs) + 1
                assert held[0] <= cdiv(6, BS) + 1, f"request {rid}: {held[0]} sliding blocks"
            # the full group holds every block of the context computed so far
            assert held[1] >= cdiv(r["computed"], BS)


GroupsMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
TestGroups = GroupsMachine.TestCase


def test_a_long_prefix_shared_past_the_window_hits_in_every_group():
    """A prompt sharing 12 tokens (three blocks, twice the window) with a finished one hits all
    three blocks: the full group holds them all, the sliding group the two the query reads."""
    cache = GroupedCache(LAYOUT, CAPACITY)
    a = list(range(1, 14))
    keys = block_keys(as_tokens(a), BS, ROOT)
    assert cache.allocate("a", keys, len(a), 8) == 0
    for start in (0, 8):
        n = min(8, len(a) - start)
        assert cache.slots("a", start, n) is not None
        cache.computed("a", start + n, keys)
        assert cache.held_blocks("a")[0] <= cdiv(6 - 1 + 8, BS) + 1
    assert cache.held_blocks("a") == [2, 4]  # blocks 2 and 3 for the query at 13 in the sliding group
    cache.free("a")
    b = a[:12] + [99, 98]
    assert cache.allocate("b", block_keys(as_tokens(b), BS, ROOT), len(b), 1) == 12
    assert [list(t) for t in cache.tables("b")][0] == [-1, 1, 2]  # blocks 1..2: positions 7..11
    cache.check_integrity()
    cache.free("b")
    # a sliding group that lost its window's block serves a shorter prefix: the block before it
    gp = cache.groups[0]
    gp.pool.evict(gp.pool.lookup[keys[2]])
    assert cache.match(block_keys(as_tokens(b), BS, ROOT), len(b)) == 2


def test_offloading_a_long_request_moves_only_the_windows_blocks_of_the_sliding_group():
    """A 64-token request (16 blocks) offloads its 16 full-group blocks and, of the sliding
    group, only the two its next query reads; restored, both groups serve its next steps."""
    cache = GroupedCache(LAYOUT, CAPACITY, host_capacities=HOST)
    toks = list(range(1, 65))
    keys = block_keys(as_tokens(toks), BS, ROOT)
    assert cache.allocate("a", keys, len(toks), 8) == 0
    for start in range(0, 64, 8):
        cache.slots("a", start, 8)
        cache.computed("a", start + 8, keys)
    cache.set_chunk("a", 1)
    copies = group_tiers.offload(cache, "a")
    moved = [len(gc.plan.src) for gc in copies]
    assert moved == [2, 16] and moved[0] <= cdiv(6, BS) + 1  # blocks 14, 15: positions 59..63 for the query at 64
    group_tiers.offloaded(cache, "a", True)
    assert cache.held_blocks("a") == [0, 0]
    back = group_tiers.restore(cache, "a")
    assert [len(gc.plan.dst) for gc in back] == [2, 16]
    group_tiers.restored(cache, "a", True)
    assert [list(np.nonzero(t >= 0)[0]) for t in cache.tables("a")] == [[14, 15], list(range(16))]
    cache.slots("a", 64, 1)
    cache.check_integrity()

"""The pool's C loops (insert_many, release_many) against their Python definitions."""
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastkv.cache.pool import BlockPool

KEYS = [b"k%d" % i for i in range(8)]  # few keys: duplicates, cached holders and shared parents are common


def snapshot(p: BlockPool):
    return (p.state, p.ref, p.key, p.parent, p.lookup, p.kids, p.free, list(p.evictable), p.num_allocated)


@st.composite
def scenarios(draw):
    cap = draw(st.integers(4, 12))
    held = draw(st.integers(0, cap - 2))
    # blocks keyed before the insert, then released (CACHED) or kept (held): (key index, keep held)
    pre = draw(st.lists(st.tuples(st.integers(0, 7), st.booleans()), max_size=held))
    n = draw(st.integers(0, cap - len(pre)))
    keys = draw(st.lists(st.sampled_from(KEYS), min_size=n, max_size=n))
    parents = draw(st.lists(st.one_of(st.none(), st.sampled_from(KEYS)), min_size=n, max_size=n))
    return cap, pre, keys, parents


def build(cap, pre):
    p = BlockPool("device", cap)
    for ki, keep in pre:
        b = p.take()
        p.set_key(b, KEYS[ki])
        if not keep:
            p.release(b)
    return p


@given(scenarios())
def test_insert_many_equals_its_reference(scenario):
    cap, pre, keys, parents = scenario
    fast, ref = build(cap, pre), build(cap, pre)
    blocks = fast.take_many(len(keys))
    assert ref.take_many(len(keys)) == blocks
    assert fast.insert_many(blocks, keys, parents) == ref._insert_many_reference(blocks, keys, parents)
    assert snapshot(fast) == snapshot(ref)
    fast.check_integrity()


def test_insert_many_refuses_mismatched_lengths_and_bad_blocks():
    p = BlockPool("device", 4)
    b = p.take()
    with pytest.raises(ValueError, match="1 blocks, 1 keys, 2 parents"):
        p.insert_many([b], [b"k"], [None, None])
    with pytest.raises(IndexError, match="block id 9 out of range"):
        p.insert_many([9], [b"k"], [None])


@st.composite
def releases(draw):
    cap = draw(st.integers(2, 10))
    # each taken block: (extra holders, keyed, pinned by a copy)
    rarely = st.sampled_from([False, False, False, True])
    often = st.sampled_from([True, True, True, False])
    blocks = draw(st.lists(st.tuples(st.integers(0, 2), often, rarely), min_size=1, max_size=cap))
    order = draw(st.lists(st.integers(0, len(blocks) - 1), max_size=2 * len(blocks)))  # repeats: double frees
    return cap, blocks, order, draw(often)


def build_held(cap, blocks):
    p = BlockPool("device", cap)
    ids = p.take_many(len(blocks))
    for b, (extra, keyed, pinned) in zip(ids, blocks, strict=True):
        for _ in range(extra):
            p.incref(b)
        if keyed:
            p.set_key(b, b"k%d" % b)
        if pinned:
            p.pin(b)
    return p, ids


def outcome(f):
    try:
        f()
    except ValueError as exc:
        return str(exc)
    return None


@given(releases())
def test_release_many_equals_its_reference(scenario):
    cap, blocks, order, keep = scenario
    (fast, ids), (ref, _) = build_held(cap, blocks), build_held(cap, blocks)
    table = [ids[i] for i in order]
    assert outcome(lambda: fast.release_many(table, keep)) == outcome(lambda: ref._release_many_reference(table, keep))
    assert snapshot(fast) == snapshot(ref)
    fast.check_integrity()


@st.composite
def evictions(draw):
    cap = draw(st.integers(2, 12))
    # block i gets key i under the key of a random earlier block (or the root), then is released or kept held
    parents = [draw(st.one_of(st.none(), st.integers(0, i - 1))) if i else None for i in range(cap)]
    held = draw(st.lists(st.booleans(), min_size=cap, max_size=cap))
    order = draw(st.permutations(range(cap)))  # release order: children may enter the queue before or after parents
    expected = draw(st.lists(st.integers(0, cap - 1), max_size=3))  # children a copy brings
    return cap, parents, held, order, expected


def build_cached(cap, parents, held, order, expected):
    p = BlockPool("device", cap)
    keys = [b"k%d" % i for i in range(cap)]
    p.parents.update({keys[i]: keys[pi] for i, pi in enumerate(parents) if pi is not None})
    p.parents.update({b"x%d" % i: keys[i] for i in expected})
    ids = p.take_many(cap)
    for b in ids:
        p.set_key(b, keys[b])
    for b in order:
        if not held[b]:
            p.release(b)
    p.expect([b"x%d" % i for i in expected])
    return p


@given(evictions(), st.data())
def test_evict_leaves_equals_its_reference(scenario, data):
    fast, ref = build_cached(*scenario), build_cached(*scenario)
    n = data.draw(st.integers(0, len(fast.evictable)))
    ev_fast, ev_ref = ([], []) if data.draw(st.booleans()) else (None, None)  # None: evictions not reported
    assert fast._evict_leaves(n, ev_fast) == ref._evict_leaves_reference(n, ev_ref)
    assert ev_fast == ev_ref
    assert snapshot(fast) == snapshot(ref)
    assert (fast.passed_over, fast.forced_evictions) == (ref.passed_over, ref.forced_evictions)


class CountingMap(dict):
    """A lookup map whose methods see each change, as fastkv.cache.residency's observed maps do."""

    def __init__(self):
        super().__init__()
        self.changes = 0

    def setdefault(self, key, default=None):
        self.changes += key not in self
        return dict.setdefault(self, key, default)

    def __delitem__(self, key):
        self.changes += 1
        dict.__delitem__(self, key)


def test_an_observed_lookup_map_sees_every_insert_and_eviction():
    p = BlockPool("device", 2)
    p.lookup = CountingMap()
    a, b = p.take_many(2)
    assert p.insert_many([a, b], [b"a", b"b"], [None, b"a"]) == []
    p.release_many([b, a])
    evicted = []
    p.take_many(2, evicted)
    assert evicted == [(b, b"b"), (a, b"a")] and p.lookup.changes == 4
    p.check_integrity()


def test_the_c_loops_refuse_a_dict_subclass():
    from fastkv.native.compiled import load

    with pytest.raises(TypeError, match="plain dicts"):
        load("_pool").insert_keys(CountingMap(), [None], [1], [None], {}, [0], [b"k"], [None], 2, print)


@given(st.integers(1, 12), st.lists(st.tuples(st.sampled_from(["extend", "popleft_many", "remove", "append"]),
                                              st.lists(st.integers(0, 11), max_size=6), st.integers(0, 12)),
                                    max_size=30))
def test_lru_links_equal_their_reference(cap, ops):
    from fastkv.cache.eviction.lru import LRUQueue

    fast, ref = LRUQueue(cap), LRUQueue(cap)
    for op, blocks, n in ops:
        queued = set(fast)
        if op == "extend":
            new = list(dict.fromkeys(b for b in blocks if b < cap and b not in queued))
            fast.extend(new)
            ref._extend_reference(new)
        elif op == "popleft_many":
            n = min(n, len(fast))
            assert fast.popleft_many(n) == ref._popleft_many_reference(n)
        elif op == "remove" and queued:
            b = sorted(queued)[n % len(queued)]
            fast.remove(b)
            ref.remove(b)
        elif op == "append" and len(queued) < cap:
            b = min(set(range(cap)) - queued)
            fast.append(b)
            ref.append(b)
        assert (fast.next, fast.prev, len(fast)) == (ref.next, ref.prev, len(ref))
        fast.check_integrity()

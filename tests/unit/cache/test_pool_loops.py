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
    blocks = draw(st.lists(st.tuples(st.integers(0, 2), st.booleans(), rarely), min_size=1, max_size=cap))
    order = draw(st.lists(st.integers(0, len(blocks) - 1), max_size=2 * len(blocks)))  # repeats: double frees
    return cap, blocks, order, draw(st.booleans())


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

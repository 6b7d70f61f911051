"""The pool's C insertion of computed keys against its Python definition."""
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

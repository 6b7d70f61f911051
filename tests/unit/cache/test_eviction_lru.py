import pytest

from fastkv.cache.eviction.lru import LRUQueue


def test_fifo_order_remove_and_touch():
    q = LRUQueue(6)
    for b in (3, 1, 4, 0):
        q.append(b)
    assert list(q) == [3, 1, 4, 0] and len(q) == 4
    q.remove(1)
    q.touch(3)
    assert list(q) == [4, 0, 3]
    assert q.peek() == 4 and q.popleft() == 4 and q.popleft() == 0
    q.check_integrity()
    assert 3 in q and 0 not in q and 99 not in q


def test_popleft_many_and_empty():
    q = LRUQueue(5)
    assert q.popleft() is None and q.peek() is None
    for b in range(5):
        q.append(b)
    assert q.popleft_many(3) == [0, 1, 2]
    assert list(q) == [3, 4]
    assert q.popleft_many(2) == [3, 4] and len(q) == 0
    q.check_integrity()
    q.append(2)
    assert list(q) == [2]


def test_double_append_is_a_bug():
    q = LRUQueue(2)
    q.append(1)
    with pytest.raises(AssertionError):
        q.append(1)


def test_bad_capacity():
    with pytest.raises(ValueError, match="capacity"):
        LRUQueue(-1)

"""SLRU: its exact order (probation, then protected, a full protected segment sending its
oldest back to probation), and what it is for: a prefix hit before survives a scan of one-off
prompts that LRU lets evict it. (The protocol and leaves-first contract: test_eviction.py.)"""
from fastkv.cache.eviction.slru import SLRUQueue
from tests.unit.cache.test_eviction import hot_tokens_kept


def test_slru_evicts_probation_first_then_protected_oldest_first():
    q = SLRUQueue(10)  # protected holds at most 8
    q.extend([0, 1, 2, 3])  # each used once: probation
    q.remove(1)  # a prefix hit, released again: protected
    q.append(1)
    q.touch(3)  # refreshed by a duplicate's release: protected
    q.append(4)
    assert list(q) == [0, 2, 4, 1, 3]
    assert q.popleft_many(3) == [0, 2, 4]
    assert q.popleft() == 1
    q.append(1)  # evicted contents start afresh: probation again
    assert list(q) == [1, 3]
    q.check_integrity()


def test_a_full_protected_segment_sends_its_oldest_back_to_probation():
    q = SLRUQueue(5)  # protected holds at most 4
    for b in range(5):
        q.append(b)
        q.touch(b)  # used twice: protected, until it holds more than 4
    assert list(q) == [0, 1, 2, 3, 4]  # 0 went back to probation: it goes first
    assert q.where[0] == 0 and all(q.where[b] == 1 for b in range(1, 5))
    q.check_integrity()
    assert q.popleft() == 0


def test_slru_keeps_a_prefix_hit_before_through_a_scan_that_lru_evicts():
    colds = [[100 + 10 * i + j for j in range(5)] for i in range(4)]  # two full blocks and a partial one each
    assert hot_tokens_kept("slru", 6, colds) == 4 and hot_tokens_kept("lru", 6, colds) == 0

"""The eviction seam: every registered policy keeps the protocol and the leaves-first contract;
LFU's exact eviction order; selecting a policy by name."""
import pytest

from fastkv.cache.eviction import POLICIES, EvictionPolicy, make_policy
from fastkv.cache.eviction.lfu import LFUQueue
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.pool import BlockPool


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_policy_satisfies_the_protocol(name):
    q = make_policy(name, 4)
    assert isinstance(q, EvictionPolicy) and q.capacity == 4 and len(q) == 0
    assert q.popleft() is None
    q.extend([2, 0])
    q.append(3)
    assert len(q) == 3 and 2 in q and 1 not in q and 99 not in q
    q.remove(0)
    q.forget(0)
    assert set(q) == {2, 3} and len(q) == 2
    q.check_integrity()
    assert sorted(q.popleft_many(2)) == [2, 3] and len(q) == 0
    q.check_integrity()


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_leaves_first_for_every_policy(name):
    """A chain released children first, with no access in between, leaves children first, also
    when every block of the chain was hit the same number of times."""
    q = make_policy(name, 8)
    chain = [5, 1, 6, 0]  # root 5 ... leaf 0
    for _ in range(3):  # three requests hit the whole chain and release it, last to first
        q.extend(chain[::-1])
        for b in chain:
            q.remove(b)
    q.extend(chain[::-1])
    assert q.popleft_many(4) == chain[::-1]


@pytest.mark.parametrize("name", sorted(POLICIES))
def test_pool_evicts_the_leaf_of_a_released_table_first(name):
    p = BlockPool("device", 3, name)
    table = p.take_many(3)
    for i, b in enumerate(table):
        assert p.set_key(b, b"k%d" % i)
    p.release_many(table[::-1])
    evicted = []
    p.take_many(1, evicted)
    assert evicted == [(table[2], b"k2")]
    p.check_integrity()


def test_lfu_eviction_order_exact():
    q = LFUQueue(6)
    q.extend([0, 1, 2, 3])  # each used once, queued in this order
    q.remove(1)  # block 1 hit: held, then released again -> used twice
    q.append(1)
    q.touch(3)  # block 3 refreshed by a duplicate's release -> used twice
    q.remove(2)
    q.append(2)
    q.remove(2)
    q.append(2)  # block 2: used three times
    q.append(4)  # a fresh block, used once, queued last
    assert list(q) == [0, 4, 1, 3, 2]
    assert q.popleft() == 0  # count 1, queued before 4
    q.forget(0)
    assert q.popleft_many(3) == [4, 1, 3]
    assert q.popleft() == 2 and q.popleft() is None
    q.append(2)  # evicted contents do not keep their count: 2 starts afresh
    q.append(0)
    assert list(q) == [2, 0]
    q.check_integrity()


def test_lfu_forget_resets_a_dropped_block():
    q = LFUQueue(3)
    q.extend([0, 1])
    q.touch(0)  # 0 used twice
    q.remove(0)
    q.forget(0)  # its key dropped: new contents next time
    q.append(0)
    assert list(q) == [1, 0]  # both used once; 1 queued earlier


def test_lfu_rejects_double_queue_and_bad_capacity():
    q = LFUQueue(2)
    q.append(1)
    with pytest.raises(AssertionError):
        q.append(1)
    with pytest.raises(ValueError, match="capacity"):
        LFUQueue(-1)


def hot_tokens_kept(eviction: str, num_device_blocks: int, colds: list[list[int]]) -> int:
    """A hot prompt computed and freed twice, then a scan of one-off ``colds``: how many of the
    hot prompt's tokens the device still matches."""
    m = CacheManager(CacheConfig(num_device_blocks=num_device_blocks, block_size=2, eviction=eviction))
    hot = [1, 2, 3, 4, 5]
    for i in range(2):
        a = m.allocate(f"hot{i}", hot)
        m.mark_computed(f"hot{i}", len(hot))
        m.free(f"hot{i}")
        assert a.ready
    for i, cold in enumerate(colds):
        m.allocate(f"cold{i}", cold)
        m.mark_computed(f"cold{i}", len(cold))
        m.free(f"cold{i}")
    m.check_integrity()
    return m.match(hot).num_device_tokens


def test_lfu_keeps_a_hot_prefix_that_lru_evicts():
    """One hot request hit twice, then a stream of one-off requests: LFU keeps the hot blocks,
    LRU evicts them (the oldest)."""
    colds = [[100 + 10 * i, 101 + 10 * i, 102 + 10 * i] for i in range(3)]
    assert hot_tokens_kept("lfu", 4, colds) == 4 and hot_tokens_kept("lru", 4, colds) == 0


def test_eviction_is_selected_by_name_and_checked():
    m = CacheManager(CacheConfig(num_device_blocks=4, num_host_blocks=2, eviction="lfu"))
    assert isinstance(m.device.evictable, LFUQueue) and isinstance(m.host.evictable, LFUQueue)
    with pytest.raises(ValueError, match="eviction must be one of"):
        CacheConfig(num_device_blocks=4, eviction="mru")
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        BlockPool("device", 2, "mru")


@pytest.mark.parametrize("name", ["lfu", "slru"])
def test_a_parent_passed_over_at_the_head_keeps_its_use_count(name):
    """A parent met at the head of the queue with a child still held goes back behind it with
    its count: the next victim is the block of the same rank queued after it, not the parent
    (re-queued as used once, it would come back to the head until evicted by force)."""
    p = BlockPool("device", 3, name)
    parent, child, other = p.take_many(3)
    p.parents[b"child"] = b"parent"
    for b, k in ((parent, b"parent"), (child, b"child"), (other, b"other")):
        assert p.set_key(b, k)
    p.release(parent)
    p.incref(parent)  # hit once more: used twice
    p.release(parent)
    p.release(other)
    p.incref(other)
    p.release(other)  # used twice too, queued after the parent
    q = p.evictable
    assert list(q) == [parent, other] and q.uses[parent] == 2
    evicted = []
    assert p.take(evicted) == other
    assert evicted == [(other, b"other")] and p.forced_evictions == 0 and p.passed_over == 1
    assert list(q) == [parent] and q.uses[parent] == 2
    p.check_integrity()

"""The store backlog's order (fastkv.cache.store_backlog): under pressure blocks the pool already
holds are skipped, then deep tails of unshared suffixes deferred, and shared prefixes last, across
calls as well as within one; deferred STOREs are made best first once the backlog drains; what is
not stored is counted by reason."""
import math

from hypothesis import given
from hypothesis import strategies as st

from fastkv.cache.plan import CopyKind
from fastkv.cache.store_backlog import NEAR_ROOT_BLOCKS, SHARED, TAIL, TAIL_SHARE, admit
from fastkv.cache.write_policy import StorageWrites
from tests.unit.cache.test_manager import BS, drain, toks
from tests.unit.cache.test_storage_writes import pool


def reference(ranks, in_flight, backlog):
    """What the order means, counted: shared blocks fill the whole backlog, shallowest first; tails
    only what is left of their share, shallowest first; a chain's order breaks ties."""
    kept = set()
    room = {SHARED: backlog - in_flight}
    for value in (SHARED, TAIL):
        mine = sorted((d, i) for i, (v, d) in enumerate(ranks) if v == value)
        if value == TAIL:
            room[TAIL] = math.ceil(backlog * TAIL_SHARE) - in_flight - len(kept)
        kept |= {i for _, i in mine[:max(0, room[value])]}
    return [i in kept for i in range(len(ranks))]


@given(st.lists(st.tuples(st.sampled_from((SHARED, TAIL)), st.integers(0, NEAR_ROOT_BLOCKS)), max_size=12),
       st.integers(0, 12), st.integers(0, 12))
def test_admit_keeps_what_the_reference_order_keeps(ranks, in_flight, backlog):
    assert admit(ranks, in_flight, backlog) == reference(ranks, in_flight, backlog)


def test_a_deep_tail_is_deferred_while_later_shared_prefixes_are_stored():
    """Backlog 4 (tails may fill 2): one request's two tail blocks fill the tails' share; the next
    tails are deferred, while a new prompt's first blocks (near the root) still get their STOREs.
    Without the order the second request's tails would take the room and the prefixes wait. Once
    the backlog drains the deferred ones are stored, shared first."""
    m = pool(StorageWrites.THROUGH, dev=16, host=16, storage_backlog_blocks=4)
    prefix = list(range(1, NEAR_ROOT_BLOCKS + 1))
    drain(m, m.allocate("p", toks(*prefix)).plans)
    drain(m, m.mark_computed("p", len(prefix) * BS))  # the prefix: stored, nothing in flight after
    assert m.stats.store_blocks == NEAR_ROOT_BLOCKS and m.stats.skipped_stores == 0

    def computed(rid, labels):
        """Computes a prompt; returns the STOREs its landed write-throughs asked for (left in flight)."""
        a = m.allocate(rid, toks(*labels))
        drain(m, a.plans)
        return [p for t in m.mark_computed(rid, len(labels) * BS) for p in m.complete(t, True).plans
                if p.kind is CopyKind.STORE]

    (tails_x,) = computed("x", [*prefix, 11, 12])  # past the near-root blocks: a tail, with room
    assert list(tails_x.keys) == m.keys_for(toks(*prefix, 11, 12))[-2:]
    assert computed("z", [*prefix, 21, 22]) == []  # the tails' share is full: deferred
    (shared_y,) = computed("y", [31, 32])  # a new chain's first blocks: room kept for them
    assert list(shared_y.keys) == m.keys_for(toks(31, 32))
    assert m.skipped_stores() == {"already_stored": 0, "tail": 2, "shared": 0}  # waiting
    assert computed("w", [41]) == [] and m.skipped_stores()["shared"] == 1  # the whole backlog is full
    assert m.complete(tails_x, True).plans == ()  # 2 in flight: not drained enough yet (to 1)
    (late,) = m.complete(shared_y, True).plans  # drained: the deferred, best first, as room allows
    z_tails, w = m.keys_for(toks(*prefix, 21, 22))[-2:], m.keys_for(toks(41))
    assert list(late.keys) == w + z_tails[:1]  # the shared block, then the shallower tail (tails fill 2)
    (last,) = m.complete(late, True).plans
    assert list(last.keys) == z_tails[1:]
    drain(m, [last])
    assert m.stats.late_stores == 3 and m.skipped_stores() == {"already_stored": 0, "tail": 0, "shared": 0}
    m.check_integrity()


def test_a_block_the_pool_already_holds_is_counted_not_stored():
    m = pool(StorageWrites.THROUGH, dev=8, host=8, storage_backlog_blocks=4)
    m.confirm_stored(m.keys_for(toks(5)))  # another engine stored it (a lookup found it)
    drain(m, m.allocate("a", toks(5)).plans)  # a block-aligned prompt: its last block is computed
    assert all(c.plans == () for c in drain(m, m.mark_computed("a", BS)))
    assert m.stats.skipped_by() == {"already_stored": 1, "tail": 0, "shared": 0} and m.stats.store_blocks == 0

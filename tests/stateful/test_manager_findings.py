"""Falsifying examples of the manager machine, replayed as plain tests (no hypothesis search):
the machine's own rules in the shrunk order, every invariant checked after each one.

Hypothesis replays a failure from its local database only while the machine's source is
unchanged; these keep the cases after any edit, and on a clean checkout."""
from __future__ import annotations

import pytest

from fastkv.cache.copies import Purpose
from fastkv.cache.pool import BlockState
from fastkv.cache.write_policy import WritePolicy as Policy
from tests.stateful import test_manager_machine
from tests.stateful.test_manager_machine import ManagerMachine


@pytest.fixture(autouse=True)
def no_events(monkeypatch):
    monkeypatch.setattr(test_manager_machine, "event", lambda _case: None)  # hypothesis's, outside a test


class Draws:
    """Stands in for ``st.data()``: each ``draw`` returns the next value the example drew."""

    def __init__(self, *values):
        self.values = list(values)

    def draw(self, _strategy):
        return self.values.pop(0)


def checked_by(machine, *invariants: str):
    """Call ``machine``'s rules through this, so that the named invariants run after each."""
    class Proxy:
        def __getattr__(self, name):
            rule = getattr(machine, name)

            def call(**kw):
                rule(**kw)
                for d in kw.values():
                    assert not isinstance(d, Draws) or not d.values, f"{name}: draws left unused"
                for inv in invariants:
                    getattr(machine, inv)()
            return call
    return Proxy()


def test_write_through_parent_reaching_the_host_first_is_not_evicted_before_its_child():
    """Write-through copies a chain's blocks to the host in separate plans, the parent's first,
    so the parent is the older host LRU entry; floods then press the 3-block host tier. Found by
    a long randomized run: the root was evicted from the host while its child stayed cached
    there (and on the device), a key nothing could reach any more."""
    machine = ManagerMachine()
    m = checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                   "no_strands_without_losses")
    m.setup(policy=Policy.WRITE_THROUGH, dev=7, storage=False, host=3)
    m.weight_update(go=0)
    m.allocate(labels=(0,), reserve=0, tail=1)
    m.allocate(labels=(6, 7), reserve=0, tail=0)
    m.allocate(labels=(), reserve=0, tail=0)
    m.allocate(labels=(0, 1, 2), reserve=0, tail=1)
    m.compute(data=Draws(1, 3), finish=False)
    m.compute(data=Draws(0), finish=True)
    m.compute(data=Draws(1), finish=True)
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.flood()
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.compute(data=Draws(3), finish=True)
    m.allocate(labels=(0, 1, 2), reserve=1, tail=0)
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.allocate(labels=(0, 1, 2), reserve=0, tail=0)
    for _ in range(5):
        m.flood()
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.compute(data=Draws(5, 5), finish=False)
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    machine.teardown()


def test_write_through_child_of_an_offloaded_request_is_not_stranded_behind_its_evicted_parent():
    """Found by a long randomized run (HYPOTHESIS_PROFILE=long). The chain's root
    lands on the host first; its three children fly there in a second write-through. Two floods
    evict the root from the device (the host has it), and another request's write-through takes
    the 4-block host tier's one evictable block: the root. The children then landed behind a
    parent no tier had. An in-flight write-through holds its chain's host copies."""
    machine = ManagerMachine()
    m = checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                   "no_strands_without_losses")
    m.setup(policy=Policy.WRITE_THROUGH, dev=5, host=4, storage=False)
    m.weight_update(go=0)
    m.allocate(labels=(0, 1, 2, 3), reserve=0, tail=0)
    m.compute(data=Draws(0, 2), finish=False)
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.compute(data=Draws(0), finish=True)
    m.flood()
    m.flood()
    m.offload(data=Draws(1))
    m.compute(data=Draws(2, 2), finish=False)  # its write-through finds the host full: skipped
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)  # the children land
    # which frees host blocks: the skipped copy is made now, and lands
    assert machine.m.stats.late_copies == 1 and len(machine.outstanding) == 1
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    # the machine's own strand check excuses the chain of the skipped copy: check strictly here
    assert not machine.outstanding
    assert stranded(machine) == []
    machine.teardown()


def stranded(machine: ManagerMachine) -> list[bytes]:
    """Cached keys whose parent no tier has and no request holds (the machine's
    ``no_strands_without_losses``, excusing no loss)."""
    m = machine.m
    present = set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored)
    held = {machine.dev_data[b] for req in m._reqs.values() for b in req.table}
    return [k for k in present
            if k not in machine.private and machine.parent.get(k) not in (None, *present, *held)]



def test_a_parent_of_blocks_held_or_in_flight_evicted_for_want_of_any_other_is_counted():
    """Write-through, 7 device and 3 host blocks, no storage: floods ask the device for every
    cached block while a child's write-through flies, and the host for a block while that child
    is on its way there; the only cached block left is each time the parent. It goes (a take never
    fails while blocks are cached), counted; the children it would strand are dropped, in flight or
    cached (strands.py). Found by a long randomized run."""
    machine = ManagerMachine()
    m = checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                   "no_key_stranded_by_eviction")
    m.setup(policy=Policy.WRITE_THROUGH, host=3, storage=False, dev=7)
    m.allocate(labels=(), reserve=0, tail=0)
    m.extend_a_block_in_flight(labels=(9, 10))
    m.free(cache=False, data=Draws(0))
    m.free(cache=True, data=Draws(1))
    m.allocate(labels=(), reserve=0, tail=1)
    m.offload(data=Draws(2))
    m.flood()
    m.fail(data=Draws(Purpose.WRITE_THROUGH, 0))
    m.match(labels=())
    m.offload(data=Draws(3))
    m.free(cache=False, data=Draws(2))
    m.free(cache=False, data=Draws(3))
    m.allocate(labels=(9,), reserve=0, tail=1)
    m.flood()
    m.flood()
    m.compute(data=Draws(4), finish=True)
    m.extend_a_block_in_flight(labels=())
    m.complete(data=Draws(Purpose.WRITE_BACK, 1), ok=True)
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    assert machine.m.device.forced_evictions
    assert stranded_cached(machine) == []
    machine.teardown()


def test_an_offloaded_request_freed_uncached_strands_no_child_of_its_host_blocks():
    """Write-through, 5 device and 4 host blocks, no storage. A request offloaded to the host
    holds the only copy of a chain's root there; another request's write-through lands a child of
    it on the host. Freeing the offloaded request without caching its blocks dropped the root
    from its last tier unrecorded, leaving the child cached behind it. Found by a long randomized
    run (HYPOTHESIS_PROFILE=long)."""
    machine = ManagerMachine()
    m = checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                   "no_key_stranded_by_eviction")
    m.setup(policy=Policy.WRITE_THROUGH, dev=5, host=4, storage=False)
    m.weight_update(go=0)
    m.extend_a_block_in_flight(labels=(0,))
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.append(data=Draws(0), n=1)
    m.offload(data=Draws(0))
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.compute(data=Draws(1), finish=True)
    m.flood()
    m.flood()
    m.extend_a_block_in_flight(labels=())
    m.free(cache=False, data=Draws(0))
    assert stranded_cached(machine) == []
    machine.teardown()


def machine_checking_strands() -> tuple[ManagerMachine, object]:
    machine = ManagerMachine()
    return machine, checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                               "no_key_stranded_by_eviction")


def test_a_write_through_landing_after_its_request_was_freed_uncached_keys_nothing_under_a_dropped_parent():
    """Write-through, 4 device and 2 host blocks. A chain's write-through flies when its request
    is freed without caching: its parent leaves every tier. Landing, the child had lost its
    parent link with its device key and was keyed on the host as a root nothing could reach.
    A key gone while a copy brings it keeps its parent link, and lands only under its parent."""
    machine, m = machine_checking_strands()
    m.setup(policy=Policy.WRITE_THROUGH, host=2, dev=4, storage=False)
    m.extend_a_block_in_flight(labels=(0, 6, 8))
    m.extend_a_block_in_flight(labels=(0, 1, 2, 3))
    for _ in range(3):
        m.extend_a_block_in_flight(labels=())
    m.extend_a_block_in_flight(labels=(0, 1))
    m.extend_a_block_in_flight(labels=())
    m.extend_a_block_in_flight(labels=())
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=False)
    m.free(cache=False, data=Draws(0))
    m.extend_a_block_in_flight(labels=(0, 1, 2))
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    assert stranded_cached(machine) == []
    machine.teardown()


def test_a_failed_write_through_whose_source_lost_its_parent_leaves_no_child_cached_behind_it():
    """Write-through, 4 device and 2 host blocks. A parent's write-through fails while its
    source's own parent is gone: the loss unkeyed the source, the failure took the last copy, and
    its child, the source of a second write-through that fails too, went CACHED on the device
    behind it. A failed write-through now records its key's departure when it was the last copy."""
    machine, m = machine_checking_strands()
    m.setup(policy=Policy.WRITE_THROUGH, dev=4, host=2, storage=False)
    m.extend_a_block_in_flight(labels=(0, 1, 2))
    for _ in range(3):
        m.extend_a_block_in_flight(labels=())
    m.free(cache=True, data=Draws(0))
    m.extend_a_block_in_flight(labels=(6, 7, 2))
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=False)
    m.extend_a_block_in_flight(labels=())
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=False)
    assert stranded_cached(machine) == []
    machine.teardown()


def stranded_cached(machine: ManagerMachine) -> list[bytes]:
    """CACHED keys, in either tier, whose parent no tier has nor a copy brings (the integrity
    check's ``_no_key_stranded``)."""
    m = machine.m
    present = set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored) | set(m.copies.inflight) \
        | set(m.copies.loading)
    return [k for pool in (m.device, m.host) for b, k in enumerate(pool.key)
            if k is not None and pool.state[b] == BlockState.CACHED and k not in machine.private
            and machine.parent.get(k) not in (None, *present)]


def test_a_reset_that_drops_a_parent_only_storage_had_drops_its_child_on_the_host_in_flight():
    """Write-through with storage, 4 device and 2 host blocks. reset_prefix_cache drops every
    stored key; one was the parent of a host block a STORE pinned (so it kept its key). Only
    the parents dropped from the pools were noted lost: when the STORE failed, the child went
    CACHED behind a parent in no tier. Found by the residency machine's teardown."""
    from tests.events.test_residency_machine import ResidencyMachine

    machine = ResidencyMachine()
    m = checked_by(machine, "integrity", "keys_point_at_their_bytes", "ready_requests_hold_their_tokens",
                   "no_key_stranded_by_eviction")
    m.setup(policy=Policy.WRITE_THROUGH, dev=4, host=2, storage=True)
    m.extend_a_block_in_flight(labels=(0,))
    m.complete(data=Draws(Purpose.WRITE_THROUGH, 0), ok=True)
    m.complete(data=Draws(Purpose.STORE, 0), ok=True)
    m.free(cache=True, data=Draws(0))
    m.free(cache=True, data=Draws(1))
    m.flood()
    m.flood()
    m.complete(data=Draws(Purpose.WRITE_BACK, 0), ok=True)
    m.reset_prefix_cache(go=0)
    m.extend_a_block_in_flight(labels=(6,))
    m.free_while_copying(cache=True, data=Draws("WRITE_BACK", 3))
    m.fail(data=Draws(Purpose.WRITE_BACK, 0))
    m.allocate(labels=(), reserve=0, tail=0)
    m.free(cache=True, data=Draws(2))
    m.fail(data=Draws(Purpose.STORE, 0))
    assert stranded_cached(machine) == []
    machine.teardown()

# ruff: noqa: E501  (replayed draws: one rule a line, as hypothesis printed them)
"""Falsifying examples of the scheduler machine, replayed as plain tests: its rules in the
shrunk order, every invariant checked after each (see test_manager_findings.py).

The first two were found by CI's derandomized profile (the examples it generates depend on keys that
differ between runs, so a local run can pass): under write-through with a
storage tier, a storage-mode preemption whose blocks were all on the host already copied
nothing, so ``CacheManager.offload`` returned no plans (which told the scheduler "OFFLOADED
now") and kept the victim's STOREs for "the next call that returns plans"; when none came
before the check, the cache had a copy open that the scheduler had never handed out ("plans in
flight [...] != the cache's open copies"). ``offload`` returns its STOREs, and the scheduler
asks ``CacheManager.is_offloaded`` instead of reading an empty tuple. The third is the CI
profile's example behind the end-of-run invariant (see its docstring)."""
from __future__ import annotations

import pytest

from fastkv.cache.write_policy import WritePolicy
from fastkv.sched import PreemptionMode
from fastkv.sched.queues import QueuePolicy
from tests.stateful import test_sched_machine
from tests.stateful.test_manager_findings import Draws, checked_by
from tests.stateful.test_sched_machine import SchedulerMachine


@pytest.fixture(autouse=True)
def no_events(monkeypatch):
    monkeypatch.setattr(test_sched_machine, "event", lambda _case: None)  # hypothesis's, outside a test


def shared_start():
    """The rules both examples begin with (they part at the next step)."""
    machine = SchedulerMachine()
    m = checked_by(machine, "integrity")
    m.setup(dev=8, mode=PreemptionMode.RECOMPUTE, policy=QueuePolicy.FCFS, budget=16, max_seqs=5, host=16, cache_policy=WritePolicy.WRITE_THROUGH, patience=4, storage=True, max_loading=None, chunked=True, watermark_admission=False, share=0)
    m.abort_before_its_swap_in(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 2, [45, 20, 6, 47, 10, 16, 13, 44, 37]), fail=True)
    m.reserve_prefilled(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [34, 29, 33, 32]), max_new=6)
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [40, 10], 1), eos=True, max_new=15, mode=None, priority=0)
    m.storage_loses_a_key(data=Draws(b'&\x9f\x1f\xe0\xeak\xdb\t\x0f\x02\x05\xe9v\xd8\xc0\xec\xc9\xc1\xf8\xfb\xd9\xa2\xb2\xca\xe9\x15S\x16\xd6\x18\x8f\xc4'))
    m.abort_before_its_swap_in(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [14, 35, 41, 30, 33, 16, 5, 7, 25]), fail=False)
    m.abort_before_its_swap_in(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [9, 26, 34, 23, 37, 1, 2, 13, 5]), fail=False)
    m.add(data=Draws([140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151], 3, [23, 1, 8, 20, 28, 5, 30, 32, 33], 1), eos=True, max_new=12, mode=PreemptionMode.OFFLOAD, priority=0)
    m.fail(data=Draws('SWAP_OUT nobody', 0))
    m.prefilled_arrives(i=13, roll=0)
    m.fail(data=Draws('SWAP_OUT nobody', 0))
    m.step(hold=True, n=2)
    m.storage_loses_a_key(data=Draws(b'\x83=\xfdB\xd5\xca1\xc2\xed\x87\xd7\xa0\xe6\x11\xf8\xed\xef\x88\xb2\xcd\x0b!\x87\xca,\xef\xdc\xce3\x80D\x88'))
    m.step(hold=False, n=2)
    m.begin_weight_update(drain=True, free=False, go=1)
    m.fail(data=Draws('SWAP_OUT nobody', 0))
    m.step(hold=True, n=4)
    m.abort_before_its_swap_in(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [9, 9, 32, 34, 37, 15, 13]), fail=False)
    m.reserve_prefilled(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 1, [27, 24, 34, 11, 24]), max_new=3)
    m.begin_weight_update(drain=False, free=True, go=1)
    m.step(hold=False, n=4)
    m.add(data=Draws([140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151], 0, [28], 1), eos=False, max_new=6, mode=None, priority=0)
    m.begin_weight_update(drain=True, free=True, go=0)
    m.step(hold=False, n=3)
    m.fail(data=Draws('STORE nobody', 0))
    m.add(data=Draws([140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151], 3, [44, 23, 25, 38, 1], 1), eos=True, max_new=3, mode=None, priority=0)
    m.step(hold=False, n=2)
    m.storage_loses_a_key(data=Draws(b'\x16\xf64F\xdc\xe6;\xe2T\xefI\xc8\xc8#I\x9c\x9f\x13\xad\x82\xd3\xd9\xb5\x8f\xfb,\xf2\xc3\xd2\xc8\xc2\xb2'))
    m.storage_loses_a_key(data=Draws(b"i\xe9\xe8o\x173\x12hU0\x9eav\xf2q'2\xd6\xb5\xed\xf2\xdfU\xa0S\x97\x81>/\x8e\x92\x16"))
    m.step(hold=False, n=4)
    m.storage_loses_a_key(data=Draws(b'/\x8d\xba\xd8\x85\x8ew`\x85;I\xa6\xd9\xda\x80\xc0%\x8c\xf83Pt`\x8d\x19\xfdb\x9c\x13K\xbd\\'))
    m.reserve_prefilled(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [15, 34, 14, 20, 43, 28, 6, 1, 17]), max_new=4)
    m.add(data=Draws([140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151], 0, [47, 35, 21, 7], 1), eos=True, max_new=11, mode=PreemptionMode.STORAGE, priority=0)
    m.finish_weight_update()
    m.begin_weight_update(drain=True, free=False, go=1)
    m.begin_weight_update(drain=False, free=True, go=0)
    m.storage_loses_a_key(data=Draws(b'\x8am\x82*\xbc\xce?\rX\xd7\x7f\x01\xc6\xa4\xf8R\x07s\xc6wI\x97\xf7\x82\x07!\xb4\xb9\x1bS\xd8\x99'))
    m.storage_loses_a_key(data=Draws(b'\xb9\xd0TF\x9e+\x00\xcb\xb3N\xfdK&f\x08\x87b \x9ca\xe4\x1c\x87\x93=\x04\xfd\x9f;\x1a\xfb\x9d'))
    return machine, m


def test_storage_preemption_with_nothing_to_copy_hands_out_its_stores_at_teardown():
    machine, m = shared_start()
    m.step(hold=True, n=1)
    m.fail(data=Draws('RESTORE nobody', 0))
    m.step(hold=True, n=2)
    m.storage_loses_a_key(data=Draws(b'\x8flE\t\xfb,:\xe4\xc8X\xf2\xd0\xd1\x04\xb2J$\xa4\xb9\xf3\x98\xd4\x98M\xf3L\x17\xdb\xac\x97w;'))
    m.complete(data=Draws('CLEAR nobody', 0), rolls=[3, 2, 1])
    m.storage_loses_a_key(data=Draws(b"Rw\xfdm\xf8\xd8\x0c'\xd6EJ\xbf\xceh[L\xb5\x89\x94\xf9I\xac\xc1\x983\x9fM\xd2\x11\x84.P"))
    m.step(hold=False, n=1)
    m.finish_weight_update()
    m.storage_loses_a_key(data=Draws(b'\x8eM+Tc\xdd\xd2\xc5\x0c\xc7xfT\x14\x8e\xd1\x13\xae\xf7z~\xe88\xf9\x7f\x01-&R*E\x95'))
    m.step(hold=True, n=1)
    m.fail(data=Draws('RESTORE nobody', 0))
    m.begin_weight_update(drain=False, free=True, go=4)
    m.step(hold=True, n=2)
    m.fail(data=Draws('SWAP_OUT nobody', 2))
    m.fail(data=Draws('SWAP_OUT nobody', 1))
    m.complete(data=Draws('SWAP_OUT nobody', 0), rolls=[0, 2])
    m.step(hold=True, n=2)
    m.step(hold=True, n=1)
    m.fail(data=Draws('SWAP_OUT LOADING', 2))
    m.storage_loses_a_key(data=Draws(b"\xcbw17e\xfe\xb6%\xac\x94\xe0\x9e\xd6>\n\x0c\xe0M\xab\xfc\x1d\x0f\xb6\x19\xc1\x881'\xa6-#\xbf"))
    m.complete(data=Draws('SWAP_OUT nobody', 1), rolls=[0])
    m.step(hold=False, n=1)
    m.begin_weight_update(drain=False, free=True, go=2)
    m.step(hold=False, n=3)
    m.begin_weight_update(drain=True, free=False, go=1)
    m.begin_weight_update(drain=False, free=True, go=4)
    m.storage_loses_a_key(data=Draws(b'\xc4\x19s\xbb\t\x0b<\x1d\xc6ZQf"\xef\x1c-\xa47\xe8L\xd3?\xe2Y;\xb5!Z\xab@B\xc5'))
    m.step(hold=False, n=4)
    m.offload_evict_restore(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 3, [30]), then='update')
    m.fail(data=Draws('SWAP_IN LOADING restore', 0))
    m.step(hold=True, n=2)
    m.add(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [40, 36, 29], 1), eos=False, max_new=14, mode=None, priority=0)
    m.step(hold=False, n=4)
    m.reserve_prefilled(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [19, 21, 33, 5, 18, 17, 31, 40, 40]), max_new=3)
    m.step(hold=False, n=1)
    m.step(hold=False, n=2)
    m.finish_weight_update()
    m.add(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 0, [1, 3, 4, 3, 20, 26, 29], 1), eos=False, max_new=10, mode=PreemptionMode.STORAGE, priority=0)
    m.begin_weight_update(drain=True, free=False, go=3)
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 1, [33], 1), eos=False, max_new=4, mode=None, priority=0)
    m.storage_loses_a_key(data=Draws(b'z>x\x0c\x03\xed(\xd7\xec\r\x08\x80\xd7\x86x\x83H\x9d+\\3\x9fT1\xae\xf0Pz\xe26\xf5\xe0'))
    m.offload_evict_restore(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [39, 35, 11]), then='press')
    machine.teardown()


def test_storage_preemption_with_nothing_to_copy_hands_out_its_stores_before_a_restore():
    machine, m = shared_start()
    m.step(hold=False, n=4)
    m.storage_loses_a_key(data=Draws(b'\xb0&\xb7\x03\xb22\xcd\x8dNn\x0ei\xe5JF>\xfc\xfa\xac) \xa3\xf3\xa0g\xae)5z\x89\xb7\x91'))
    m.finish_weight_update()
    m.storage_loses_a_key(data=Draws(b'\x8flE\t\xfb,:\xe4\xc8X\xf2\xd0\xd1\x04\xb2J$\xa4\xb9\xf3\x98\xd4\x98M\xf3L\x17\xdb\xac\x97w;'))
    m.begin_weight_update(drain=False, free=True, go=1)
    m.step(hold=False, n=1)
    m.step(hold=False, n=2)
    m.step(hold=True, n=2)
    m.begin_weight_update(drain=True, free=True, go=2)
    m.begin_weight_update(drain=False, free=True, go=1)
    m.fail(data=Draws('SWAP_OUT nobody', 1))
    m.step(hold=True, n=4)
    m.storage_loses_a_key(data=Draws(b'\x8eM+Tc\xdd\xd2\xc5\x0c\xc7xfT\x14\x8e\xd1\x13\xae\xf7z~\xe88\xf9\x7f\x01-&R*E\x95'))
    m.abort_while_copying(data=Draws('SWAP_OUT', 5))
    m.offload_evict_restore(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 0, [6, 43]), then='fail')
    machine.teardown()


class FirstLoadingKey:
    """The draw of ``storage_loses_a_key_being_loaded``: the key was printed as bytes, the first
    one a LOAD in flight reads (the only one then); chained keys have changed since."""

    values = ()

    def draw(self, strategy):
        return strategy.elements[0]


def test_a_failed_restore_recomputes_into_no_block_a_copy_reads():
    """The CI profile's example of the leak hunt (8 device blocks, chunked prefill, a budget of 3,
    16 host blocks, storage, weight updates, storage preemption, failed offloads): a request
    offloaded with its first block evicted from the device and later ones still cached there was
    restored reusing those later blocks; its swap-in failed, so it recomputed from the start into
    blocks that other copies in flight were reading ("step 25: request 4 writes blocks {0} that a
    copy in flight reads or writes", in the teardown). A restore reuses only the leading run of
    its blocks still on the device (``offload.restore``)."""
    machine = SchedulerMachine()
    m = checked_by(machine, "integrity")
    m.setup(dev=8, chunked=True, budget=3, host=16, max_seqs=6, watermark_admission=False, cache_policy=WritePolicy.WRITE_THROUGH, policy=QueuePolicy.PRIORITY, patience=3, mode=PreemptionMode.RECOMPUTE, max_loading=3, storage=True, share=0)
    m.begin_weight_update(drain=True, free=False, go=1)
    m.add(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [44], 1), eos=True, max_new=15, mode=PreemptionMode.STORAGE, priority=1)
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 1, [14, 1], 1), eos=False, max_new=8, mode=None, priority=0)
    m.add_stored_elsewhere(data=Draws([140, 141, 142, 143, 144, 145, 146, 147, 148, 149, 150, 151], 2, [1, 16, 35, 8, 43, 18, 38, 9]), max_new=8)
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [1, 1, 1, 1, 1, 1], 1), eos=False, max_new=9, mode=None, priority=1)
    m.offload_in_flight(data=Draws(4), then='fail')
    m.storage_loses_a_key_being_loaded(data=FirstLoadingKey())
    m.fail(data=Draws('LOAD LOADING', 1))
    m.add(data=Draws([120, 121, 122, 123, 124, 125, 126, 127, 128, 129, 130, 131], 1, [1], 1), eos=False, max_new=7, mode=PreemptionMode.OFFLOAD, priority=0)
    m.begin_weight_update(drain=False, free=True, go=1)
    m.complete(data=Draws('SWAP_OUT nobody', 0, 'SWAP_OUT nobody', 0, 'SWAP_OUT nobody', 0), rolls=[1, 1, 1, 0])
    m.offload_in_flight(data=Draws(), then='abort')
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [4, 15], 1), eos=False, max_new=12, mode=None, priority=1)
    m.fail(data=Draws('SWAP_OUT nobody', 3))
    m.complete(data=Draws('SWAP_IN LOADING', 7), rolls=[0])
    m.deliver()
    m.complete(data=Draws('STORE nobody', 0, 'STORE nobody', 0), rolls=[0, 0])
    m.complete(data=Draws('STORE nobody', 0), rolls=[0])
    m.complete(data=Draws('SWAP_OUT nobody', 0, 'SWAP_OUT nobody', 0, 'SWAP_OUT nobody', 0, 'SWAP_OUT nobody', 0), rolls=[1, 2, 1, 0])
    m.offload_in_flight(data=Draws(4), then='fail')
    m.complete(data=Draws('STORE nobody', 0, 'SWAP_OUT nobody', 2, 'STORE nobody', 0), rolls=[0, 0, 0])
    m.fail(data=Draws('STORE nobody', 0))
    m.deliver()
    m.offload_in_flight(data=Draws(1), then='land')
    m.run_until_a_restore(evict=True, held=1, then='fail')
    m.add(data=Draws([100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 110, 111], 0, [1], 1), eos=False, max_new=2, mode=None, priority=0)
    m.deliver()
    m.fail(data=Draws('STORE nobody', 1))
    m.offload_in_flight(data=Draws(), then='abort')
    machine.teardown()

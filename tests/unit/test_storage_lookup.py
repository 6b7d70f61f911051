"""The engine's storage lookup lane without processes: waves, per-rank answers, deadlines, order."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.engine.lookup import StorageLookup
from fastkv.ipc import DoneMsg
from fastkv.sched.request import Request

BS = 4


class Clock:
    t = 100.0

    def __call__(self) -> float:
        return self.t


def setup(timeout: float = 0.5):
    cache = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=16, block_size=BS, storage=True))
    clock = Clock()
    return cache, clock, StorageLookup(cache, timeout, clock=clock)


def ack(task_id: int, rank: int, found: list[int], ok: bool = True) -> DoneMsg:
    return DoneMsg(task_id, rank, ok, found=np.array(found, np.int32).tobytes())


def test_one_wave_and_the_prefix_every_rank_confirms():
    cache, clock, lk = setup()
    a, b = Request(0, list(range(17)), 4), Request(1, list(range(100, 109)), 4)
    lk.park(a)
    lk.park(b)
    plans = lk.wave()
    assert len(plans) == 1 and plans[0].kind is CopyKind.LOOKUP  # one task for the whole wave
    assert plans[0].chain_lengths.tolist() == [4, 2]  # full blocks before the last token: 16//4, 8//4
    assert lk.release() == [] and lk.wave() == []  # nobody asked twice; both wait for the answer
    tid = plans[0].plan_id
    lk.on_ack(ack(tid, 0, [4, 1]))
    lk.on_ack(ack(tid, 1, [2, 2]))
    lk.complete(tid, True, 2)
    assert [r.request_id for r, aborted in lk.release()] == [0, 1]
    assert len(cache.match(a.token_ids).storage_keys) == 2 and len(cache.match(b.token_ids).storage_keys) == 1
    assert lk.stats.keys_found == 3 and lk.stats.keys_asked == 6


def test_a_failed_lookup_confirms_nothing_and_a_late_one_is_bounded():
    cache, clock, lk = setup(timeout=0.5)
    a = Request(0, list(range(9)), 4)
    lk.park(a)
    (plan,) = lk.wave()
    clock.t += 0.4
    assert lk.release() == [] and 0 < lk.wait_s(1.0) <= 0.1 + 1e-9
    clock.t += 0.2  # past its deadline: it goes with what is confirmed (nothing)
    assert [r for r, _ in lk.release()] == [a] and lk.stats.timed_out == 1
    lk.on_ack(ack(plan.plan_id, 0, [2]))
    lk.complete(plan.plan_id, False, 1)  # one rank failed: nothing confirmed
    assert cache.match(a.token_ids).storage_keys == () and lk.stats.failed == 1


def test_arrival_order_holds_and_aborts_while_parked_are_reported():
    cache, clock, lk = setup()
    cache.confirm_stored(cache.keys_for(list(range(9)))[:2])  # already known: nothing to ask for it
    slow, known = Request(0, list(range(50, 59)), 4), Request(1, list(range(9)), 4)
    lk.park(slow)
    lk.park(known)
    (plan,) = lk.wave()
    assert plan.chain_lengths.tolist() == [2]  # only the unknown request is asked about
    assert lk.abort(1) and not lk.abort(7)
    assert lk.release() == []  # the known one waits behind the earlier arrival
    lk.complete(plan.plan_id, True, 0)
    assert [(r.request_id, ab) for r, ab in lk.release()] == [(0, False), (1, True)]


class CountingStore:
    """Holds ``held``; records every batch ``exists`` was asked."""

    def __init__(self, held: set[bytes]) -> None:
        self.held, self.asked = held, []

    def exists(self, keys):
        self.asked.append(list(keys))
        return [k in self.held for k in keys]


def test_a_wave_asks_the_store_about_each_key_once_however_many_chains_share_it():
    from fastkv.storage.lookup import found_prefixes

    store = CountingStore({b"a", b"b", b"c"})
    chains = [b"a", b"b", b"c", b"d"], [b"a", b"b"], [b"a", b"x", b"c"]
    keys = [k for c in chains for k in c]
    found = found_prefixes(store, keys, np.array([len(c) for c in chains], np.int32))
    assert found.tolist() == [3, 2, 1]
    assert len(store.asked) == 1 and sorted(store.asked[0]) == [b"a", b"b", b"c", b"d", b"x"]


def test_prefetch_best_effort_never_holds_a_request_back():
    cache = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=16, block_size=BS, storage=True))
    lk = StorageLookup(cache, 0.5, clock=Clock(), policy="best_effort")
    a = Request(0, list(range(9)), 4)
    lk.park(a)
    (plan,) = lk.wave()  # still asked: its answer serves the requests after it
    assert [r for r, _ in lk.release()] == [a] and lk.wait_s(1.0) == 1.0
    lk.complete(plan.plan_id, True, 0)


def test_prefetch_wait_complete_holds_a_request_until_its_answer():
    cache = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=16, block_size=BS, storage=True))
    clock = Clock()
    lk = StorageLookup(cache, 0.5, clock=clock, policy="wait_complete")
    a = Request(0, list(range(9)), 4)
    lk.park(a)
    (plan,) = lk.wave()
    clock.t += 3600
    assert lk.release() == [] and lk.wait_s(1.0) == 1.0 and lk.stats.timed_out == 0
    lk.on_ack(ack(plan.plan_id, 0, [2]))
    lk.complete(plan.plan_id, True, 1)
    assert [r for r, _ in lk.release()] == [a] and len(cache.match(a.token_ids).storage_keys) == 2


def test_where_lookups_take_longer_than_the_timeout_the_wait_stretches_to_two_round_trips():
    """A busy machine answered lookups later than the 0.2 s default, so requests
    went without them and recomputed what storage held. The wait stretches to twice the recent
    round trip (at most 10x the setting), and stays the setting where lookups are quick."""
    cache, clock, lk = setup(timeout=0.5)

    def answered_after(rtt, n=9):
        lk.park(Request(n, list(range(n * 100, n * 100 + 9)), 4))
        (plan,) = lk.wave()
        clock.t += rtt
        lk.on_ack(ack(plan.plan_id, 0, [0]))
        lk.complete(plan.plan_id, True, 1)
        lk.release()

    answered_after(0.1)
    late = Request(0, list(range(9)), 4)
    lk.park(late)
    lk.wave()
    clock.t += 0.6  # past the setting, and lookups are quick here: it goes
    assert [r for r, _ in lk.release()] == [late] and lk.stats.timed_out == 1
    answered_after(1.0, 10)  # slow now: EWMA 0.1 + 0.2 x 0.9 = 0.28; a second: 0.28 + 0.2 x 1.72 = 0.624
    answered_after(2.0, 11)
    slow = Request(1, list(range(50, 59)), 4)
    lk.park(slow)
    lk.wave()
    clock.t += 1.2  # within 2 x 0.624
    assert lk.release() == [] and lk.wait_s(1.0) == pytest.approx(0.048)
    clock.t += 0.1
    assert [r for r, _ in lk.release()] == [slow] and lk.stats.timed_out == 2


def test_prefetch_timeout_grows_with_the_prompt():
    cache = CacheManager(CacheConfig(num_device_blocks=1024, num_host_blocks=16, block_size=BS, storage=True))
    clock = Clock()
    lk = StorageLookup(cache, 0.5, clock=clock, policy="timeout", per_1k_tokens_s=1.0)
    short, long = Request(0, list(range(9)), 4), Request(1, list(range(100, 2100)), 4)
    lk.park(long)  # 2,000 tokens: 0.5 + 2 x 1.0 s
    lk.park(short)
    lk.wave()
    clock.t += 2.4
    assert lk.release() == []  # the long one, first, is still within its wait
    clock.t += 0.2
    assert [r for r, _ in lk.release()] == [long, short] and lk.stats.timed_out == 2


def test_prefetch_policy_names_are_checked():
    cache = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=16, block_size=BS, storage=True))
    with pytest.raises(ValueError, match="prefetch policy must be one of"):
        StorageLookup(cache, 0.5, policy="eager")

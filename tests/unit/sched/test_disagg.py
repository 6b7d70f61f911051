"""Disaggregated serving on the decode instance: reservations that keep the running requests' growth
(or, overcommitting, a decaying watermark of it)."""
import numpy as np
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.config import KVLayout
from fastkv.engine.core import scheduler_config
from fastkv.run import RunSpec
from fastkv.sched import RefusalReason, Request, RequestState, Reservation, Scheduler, SchedulerConfig
from tests.sched_harness import Rig, sample

BS = 4
S = RequestState
PROMPT = list(range(50, 58))  # two full blocks


def decode_rig(dev=10, host=0, policy=CachePolicy.WRITE_THROUGH_SELECTIVE, **kw) -> Rig:
    cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS, policy=policy))
    cfg = dict(reserve_init_blocks=4.0, reserve_decay=0.5, reserve_min_blocks=1.0)
    cfg.update(kw)
    return Rig(Scheduler(cache, SchedulerConfig(**cfg)))


def prefilled(r: Rig, rid: int, prompt=PROMPT, max_new=4) -> Request:
    first = sample(rid, len(prompt), prompt[-1], r.worker.vocab)  # what the prefill instance sampled
    r.worker.add(rid, prompt, [first])
    return Request(rid, np.array(prompt, np.int32), max_new, output_token_ids=[first])


def arrive(r: Rig, res: Reservation, ok: bool = True) -> None:
    """The prefill instance's KV lands in the reserved blocks (or the transfer fails)."""
    if ok:
        r.worker.write(res.request_id, res.block_table, res.first_position, res.last_position)
    r.sched.on_prefilled(res.request_id, ok)
    r.sched.check_integrity()


def test_refused_while_running_requests_hold_the_watermark_then_accepted_as_it_decays():
    r = decode_rig(overcommit_growth=True)
    for i in range(2):
        r.add(i, [i + 1] * 5, max_new_tokens=20)  # two blocks each, room for 3 more tokens before growing
    r.step()
    got = r.sched.reserve_for_prefilled(prefilled(r, 10))
    assert got.reason is RefusalReason.NO_ROOM and (got.needed_blocks, got.free_blocks) == (3, 6)
    assert got.reserved_blocks == 4  # the watermark decayed once (4 -> 2 blocks each)
    assert "NO_ROOM" in got.detail and r.sched.get_request(10) is None
    r.step()  # decays to 1 block each
    res = r.sched.reserve_for_prefilled(prefilled(r, 10))
    assert isinstance(res, Reservation) and res.writable
    assert (len(res.block_table), res.first_position, res.last_position) == (3, 0, 8)
    q = r.sched.get_request(10)
    assert q.state is S.LOADING
    out = r.step()
    assert 10 not in [s.request_id for s in out.plan.seqs]  # nothing to run until its KV arrives
    arrive(r, res)
    out = r.step()
    (seq,) = [s for s in out.plan.seqs if s.request_id == 10]
    assert (seq.start_pos, len(seq.token_ids), seq.sample) == (8, 1, True)  # decodes its first token
    r.run()
    assert r.finished[10].output_token_ids == r.worker.truth[10].tokens[8:]
    assert r.finished[10].num_recomputed_tokens == 0 and len(r.finished[10].output_token_ids) == 4


def test_device_prefix_hits_shrink_what_the_prefill_instance_sends():
    r = decode_rig()
    r.add(0, PROMPT + [9], max_new_tokens=1)
    r.run()
    res = r.sched.reserve_for_prefilled(prefilled(r, 1, PROMPT + [7, 7]))
    assert res.first_position == 8 and res.last_position == 10
    arrive(r, res)
    r.run()
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[10:]


def test_failed_transfer_recomputes_here_and_abort_waits_for_the_transfer():
    r = decode_rig()
    res1 = r.sched.reserve_for_prefilled(prefilled(r, 1))
    res2 = r.sched.reserve_for_prefilled(prefilled(r, 2, [5] * 6))
    arrive(r, res1, ok=False)
    assert r.sched.get_request(1).state is S.WAITING
    assert r.sched.abort(2) and r.sched.get_request(2).state is S.LOADING  # blocks are being written
    arrive(r, res2)
    r.run()
    assert r.finished[2].state is S.FINISHED_ABORTED
    assert r.finished[1].state is S.FINISHED_LENGTH and r.finished[1].num_recomputed_tokens == 0
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[8:]
    with pytest.raises(ValueError, match="not waiting"):
        r.sched.on_prefilled(1, True)


def test_blocks_still_being_written_back_are_not_writable_yet():
    r = decode_rig(dev=4, host=8, policy=CachePolicy.WRITE_BACK)
    r.add(0, list(range(1, 13)) + [99], max_new_tokens=1)  # leaves 3 cached blocks
    r.run()
    res = r.sched.reserve_for_prefilled(prefilled(r, 1))  # evicts cached blocks: written back first
    assert not res.writable
    out = r.step()
    assert out.kv_writable == []
    r.complete_all()
    assert r.step().kv_writable == [1]
    arrive(r, res)
    r.run()
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[8:]


def test_refused_during_a_weight_update_and_when_the_batch_is_full():
    r = decode_rig(max_num_seqs=1)
    r.add(0, [1, 2], max_new_tokens=3)
    r.step()
    assert r.sched.reserve_for_prefilled(prefilled(r, 1)).reason is RefusalReason.TOO_MANY_SEQS
    r.run()
    r.sched.begin_weight_update()
    req = prefilled(r, 2)
    assert r.sched.reserve_for_prefilled(req).reason is RefusalReason.WEIGHT_UPDATE
    assert req.arrival_seq == -1  # untouched: it may be asked again


def serve(r: Rig, offers: list[Request]) -> dict[int, str]:
    """Offer prefilled requests every step, in order, as a decode engine does; the refusals."""
    refusals: dict[int, str] = {}
    for _ in range(500):
        while offers:
            got = r.sched.reserve_for_prefilled(offers[0])
            if isinstance(got, Reservation):
                # what it holds never eats into the growth the requests holding blocks may still need
                assert r.sched.cache.num_free_device_blocks >= r.sched.growth_reservation()
                arrive(r, got)
                offers.pop(0)
                continue
            assert got.reason is RefusalReason.NO_ROOM and got.needed_blocks > got.free_blocks - got.reserved_blocks
            refusals.setdefault(got.request_id, got.detail)
            break
        if not offers and not r.sched.has_work():
            return refusals
        r.step()
        r.complete_all()
    raise AssertionError("not done after 500 steps")


def test_a_decode_instance_under_pressure_refuses_and_never_preempts_its_running_requests():
    """Prefilled requests offered every step on a device that cannot hold them all: the growth
    of the running requests is reserved first, so each newcomer waits (refused with its
    reason) instead of a running request being preempted later."""
    r = decode_rig(dev=12)
    refusals = serve(r, [prefilled(r, rid, [rid + 1] * 7, max_new=12) for rid in range(8)])
    assert sorted(r.finished) == list(range(8))
    assert r.sched.stats.preemptions == 0, r.sched.stats
    assert refusals and all(f"request {rid} refused (NO_ROOM)" in why for rid, why in refusals.items())
    for rid in range(8):
        assert r.finished[rid].output_token_ids == r.worker.truth[rid].tokens[7:]


def test_a_cached_prefix_hit_is_not_counted_as_free_twice():
    """A prefix cached on the device (refcount 0) is among the free blocks; taking it must not
    also shrink what the newcomer needs, or each such hit overcommits the device."""
    r = decode_rig(dev=16)
    for i in range(4):  # four cached prefixes of two blocks each
        r.add(100 + i, [i + 1] * 8 + [0], max_new_tokens=1)
    r.run()
    refusals = serve(r, [prefilled(r, i, [i % 4 + 1] * 8 + [7 + i], max_new=12) for i in range(8)])
    assert sorted(r.finished) == [0, 1, 2, 3, 4, 5, 6, 7, 100, 101, 102, 103]
    assert r.sched.stats.preemptions == 0, r.sched.stats
    assert refusals


def test_a_mixed_engine_with_watermark_admission_holds_back_the_watermarks_only():
    """Local admission under watermark_admission keeps FastDeploy's decaying watermark (as
    before the handoff): reserving all growth is the decode role's rule (growth_admission)."""
    def newcomer_admitted(**kw) -> bool:
        r = decode_rig(**kw)
        for i in range(2):
            r.add(i, [i + 1] * 5, max_new_tokens=20)  # 2 blocks held, 5 more each at most
        r.step()  # the watermarks decay 4 -> 2 blocks each: 6 free, 4 held back
        r.add(10, [9] * 8, max_new_tokens=3)  # 2 blocks
        r.step()
        return r.sched.get_request(10).state is S.RUNNING

    assert newcomer_admitted(watermark_admission=True)
    assert not newcomer_admitted(growth_admission=True)  # 6 free, 10 held back


def test_a_decode_engine_admits_its_own_requests_without_preempting_its_running_ones():
    """Requests a decode engine computes itself (a record said ok:false) go through local
    admission; with growth_admission (set by --role decode) it holds back the same growth as
    reserve_for_prefilled, so they wait instead of costing a running request a preemption."""
    def run(**kw) -> Rig:
        r = decode_rig(dev=12, **kw)
        for rid in range(8):
            r.add(rid, [rid + 1] * 7, max_new_tokens=12)
        r.run()
        assert sorted(r.finished) == list(range(8))
        for rid in range(8):
            assert r.finished[rid].output_token_ids == r.worker.truth[rid].tokens[7:]
        return r

    assert run().sched.stats.preemptions > 0  # the pressure is real
    assert run(growth_admission=True).sched.stats.preemptions == 0


def test_the_decode_role_turns_growth_admission_on_and_a_mixed_run_keeps_the_default():
    def cfg(role: str, **opts) -> SchedulerConfig:
        return scheduler_config(RunSpec(run_id="x", layout=KVLayout(1, 1, 16, 16), num_device_blocks=8,
                                        num_host_blocks=0, role=role, scheduler=opts))

    assert not cfg("mixed").growth_admission and not cfg("prefill").growth_admission
    assert cfg("decode").growth_admission
    assert not cfg("decode", growth_admission=False).growth_admission  # the config file still decides

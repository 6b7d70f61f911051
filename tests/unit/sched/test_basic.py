"""Scheduler scenarios without preemption: budget, chunking, prefix hits, finishing, aborts, contracts."""
import numpy as np
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.sched import PreemptionMode, Request, RequestState, Scheduler, SchedulerConfig
from fastkv.sched.output import StepOutput
from tests.sched_harness import Rig, sample

BS = 4
S = RequestState


def rig(dev=16, host=0, policy=CachePolicy.WRITE_BACK, storage=False, **kw) -> Rig:
    cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS, policy=policy,
                                     storage=storage))
    return Rig(Scheduler(cache, SchedulerConfig(**kw), clock=iter(range(1, 10**6)).__next__))


def seqs(out):
    return [(s.request_id, s.start_pos, len(s.token_ids), s.sample) for s in out.plan.seqs]


def test_token_budget_and_chunked_prefill():
    r = rig(max_num_batched_tokens=8, long_prefill_token_threshold=0)  # no share: first come takes the budget
    r.add(0, range(1, 11), max_new_tokens=2)
    r.add(1, range(20, 23), max_new_tokens=2)
    assert seqs(r.step()) == [(0, 0, 8, False)]  # 8 of 10 prompt tokens; no budget left for 1
    assert seqs(r.step()) == [(0, 8, 2, True), (1, 0, 3, True)]  # rest of 0, then all of 1
    assert seqs(r.step()) == [(0, 10, 1, True), (1, 3, 1, True)]  # decode both
    r.run()
    assert {rid: q.state for rid, q in r.finished.items()} == {0: S.FINISHED_LENGTH, 1: S.FINISHED_LENGTH}
    assert r.finished[0].output_token_ids == r.worker.truth[0].tokens[10:]
    assert r.sched.stats.prefill_tokens == 13 and r.sched.stats.recomputed_tokens == 0


def test_a_long_prefill_leaves_room_for_a_short_prompt_beside_it():
    """Fair chunked prefill: the long prompt gets its share first; the newcomer is admitted in the
    same step; what nobody else takes goes back to the long prompt (every step stays full)."""
    r = rig(dev=64, max_num_batched_tokens=8, long_prefill_token_threshold=2)
    r.add(0, range(1, 41), max_new_tokens=2)
    assert seqs(r.step()) == [(0, 0, 8, False)]  # alone: the whole budget
    r.add(1, range(100, 103), max_new_tokens=2)
    assert seqs(r.step()) == [(0, 8, 5, False), (1, 0, 3, True)]  # 2 + the 3 the newcomer left
    assert seqs(r.step()) == [(0, 13, 7, False), (1, 3, 1, True)]  # a decode beside it
    r.run()
    assert r.finished[0].output_token_ids == r.worker.truth[0].tokens[40:]
    assert r.finished[1].output_token_ids == r.worker.truth[1].tokens[3:]


def test_two_long_prompts_each_progress_every_step():
    r = rig(dev=64, max_num_batched_tokens=8, long_prefill_token_threshold=3)
    r.add(0, range(1, 41), max_new_tokens=1)
    r.add(1, range(100, 140), max_new_tokens=1)
    for _ in range(4):
        out = seqs(r.step())
        assert [s[0] for s in out] == [0, 1] and sum(s[2] for s in out) == 8
        r.sched.check_integrity()


def test_the_share_defaults_to_a_quarter_of_the_budget_and_is_checked():
    assert SchedulerConfig(max_num_batched_tokens=2048).prefill_share == 512
    assert SchedulerConfig(long_prefill_token_threshold=0).prefill_share == 0
    assert SchedulerConfig(chunked_prefill=False).prefill_share == 0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="long_prefill_token_threshold"):
            SchedulerConfig(long_prefill_token_threshold=bad)


def test_without_chunking_a_prompt_waits_for_a_step_with_room():
    r = rig(max_num_batched_tokens=8, chunked_prefill=False)
    r.add(0, range(1, 6), max_new_tokens=3)
    r.add(1, range(20, 26), max_new_tokens=3)
    assert seqs(r.step()) == [(0, 0, 5, True)]  # 1's 6 tokens do not fit the 3 left
    assert seqs(r.step()) == [(0, 5, 1, True), (1, 0, 6, True)]


def test_max_num_seqs_limits_the_batch():
    r = rig(max_num_seqs=2)
    for i in range(3):
        r.add(i, [i + 1, i + 2], max_new_tokens=5)
    assert [s[0] for s in seqs(r.step())] == [0, 1]
    assert [s[0] for s in seqs(r.step())] == [0, 1]


def test_prefix_hit_on_the_device_skips_computed_tokens():
    r = rig()
    prompt = list(range(1, 10))  # two full blocks and one token
    r.add(0, prompt, max_new_tokens=1)
    r.run()
    r.add(1, prompt[:8] + [77, 78], max_new_tokens=1)
    assert seqs(r.step()) == [(1, 8, 2, True)]  # both full blocks hit
    assert r.sched.stats.prefill_tokens == 9 + 2 and r.sched.get_request(1) is None  # finished


def test_stop_tokens_eos_and_max_model_len():
    r = rig(dev=3)  # max_model_len: 12 tokens
    first = sample(0, 3, 3, 64)
    r.add(0, [1, 2, 3], max_new_tokens=10, stop_token_ids=[first])
    r.add(1, list(range(1, 11)), max_new_tokens=10)
    r.run()
    assert r.finished[0].state is S.FINISHED_STOPPED and r.finished[0].output_token_ids == [first]
    assert r.finished[1].state is S.FINISHED_LENGTH and r.finished[1].num_tokens == 12


def _abort_waiting_and_during_a_step() -> None:
    r = rig(dev=4, host=4, max_num_batched_tokens=4, preemption=PreemptionMode.OFFLOAD,
            long_prefill_token_threshold=0)  # request 0 takes the whole budget: 1 stays WAITING
    r.add(0, range(1, 9), max_new_tokens=20)
    r.add(1, range(30, 33), max_new_tokens=20)
    out = r.sched.step()  # request 0's first chunk is in flight
    assert r.sched.abort(1) and r.sched.get_request(1) is None  # waiting: gone now
    assert r.sched.abort(0) and r.sched.get_request(0).state is S.RUNNING  # in flight: deferred
    r.sched.on_step_output(r.worker.step(out.plan))
    assert r.sched.get_request(0) is None and not r.sched.abort(0)
    fin = r.step().finished
    assert [(q.request_id, q.state) for q in fin] == [(1, S.FINISHED_ABORTED), (0, S.FINISHED_ABORTED)]
    assert r.sched.cache.request_ids() == [] and not r.sched.has_work()
    r.sched.check_integrity()


def _abort_with_copies_in_flight(state: RequestState) -> None:
    """Two requests on a 5-block device: request 1 is preempted by offload, and the fake
    transfer layer holds its copies in flight (SWAP_OUT for OFFLOADING, SWAP_IN for LOADING)
    while it is aborted; they complete afterwards, against an aborted request."""
    cache = CacheManager(CacheConfig(num_device_blocks=5, num_host_blocks=8, block_size=BS,
                                     policy=CachePolicy.WRITE_THROUGH_SELECTIVE))  # restores swap in
    r = Rig(Scheduler(cache, SchedulerConfig(preemption=PreemptionMode.OFFLOAD, max_num_batched_tokens=32)))
    r.add(0, range(1, 9), max_new_tokens=8)
    q1 = r.add(1, range(20, 30), max_new_tokens=8)
    for _ in range(20):  # step, then complete the copies, until request 1 is in ``state``
        r.step()
        if q1.state is state:
            break
        r.complete_all()
        if q1.state is state:
            break
    assert q1.state is state, f"never reached {state.name}: {q1.state.name}"
    kinds = {p.kind for p, _ in r.transfer.pending}
    want = {S.OFFLOADING: {CopyKind.SWAP_OUT}, S.LOADING: {CopyKind.SWAP_IN}, S.OFFLOADED: set()}[state]
    assert want <= kinds and (state is not S.OFFLOADED or not kinds), kinds
    assert r.sched.abort(1) and r.sched.get_request(1) is None and not r.sched.abort(1)
    assert 1 not in r.sched.cache.request_ids()
    r.sched.check_integrity()
    r.complete_all()  # copies of the aborted request land after it is gone
    r.run()
    assert {rid: q.state for rid, q in r.finished.items()} == {0: S.FINISHED_LENGTH, 1: S.FINISHED_ABORTED}
    assert r.finished[1].finish_time is not None and r.sched.stats.aborted == 1
    assert r.finished[0].output_token_ids == r.worker.truth[0].tokens[8:]  # the worker checked every slot it read
    assert r.sched.cache.request_ids() == [] and not r.sched.has_work()
    assert cache.device.num_available == 5 and cache.host.num_available == 8  # nothing left pinned
    r.sched.check_integrity()


@pytest.mark.parametrize("state", [S.WAITING, S.OFFLOADING, S.OFFLOADED, S.LOADING], ids=lambda s: s.name)
def test_abort_in_every_state_and_during_a_step(state):
    """WAITING also covers RUNNING, in the step in flight (deferred) and after it."""
    if state is S.WAITING:
        _abort_waiting_and_during_a_step()
    else:
        _abort_with_copies_in_flight(state)


def test_contract_violations_raise_value_errors():
    r = rig(dev=4)
    r.add(0, [1, 2, 3], max_new_tokens=2)
    with pytest.raises(ValueError, match="already in use"):
        r.sched.add_request(Request(0, np.array([1]), 1))
    with pytest.raises(ValueError, match="max_model_len"):
        r.sched.add_request(Request(5, np.arange(1, 17), 1))
    with pytest.raises(ValueError, match="max_new_tokens"):
        Request(6, np.array([1]), 0)
    with pytest.raises(ValueError, match="empty prompt"):
        Request(6, np.array([], np.int32), 1)
    with pytest.raises(TypeError):
        Request("x", np.array([1]), 1)
    with pytest.raises(ValueError, match="without a step"):
        r.sched.on_step_output(StepOutput(1, {}, 0.0))
    out = r.sched.step()
    with pytest.raises(ValueError, match="in flight"):
        r.sched.step()
    with pytest.raises(ValueError, match="step 9"):
        r.sched.on_step_output(StepOutput(9, {0: 1}, 0.0))
    with pytest.raises(ValueError, match="no sampled token"):
        r.sched.on_step_output(StepOutput(out.plan.step_id, {}, 0.0))
    with pytest.raises(ValueError, match="not in flight"):
        r.sched.on_copy_complete(12345, True)
    r.sched.on_step_output(r.worker.step(out.plan))
    r.sched.check_integrity()
    with pytest.raises(ValueError, match="block_bytes"):
        Scheduler(r.sched.cache, SchedulerConfig(preemption=PreemptionMode.AUTO))
    with pytest.raises(ValueError, match="max_num_seqs"):
        SchedulerConfig(max_num_seqs=0)


def test_time_to_first_token_and_counts():
    r = rig()
    r.add(0, [1, 2, 3], max_new_tokens=2)
    assert r.sched.counts()["waiting"] == 1
    r.run()
    q = r.finished[0]
    assert q.arrival_time < q.first_token_time < q.finish_time


def test_a_multimodal_item_is_never_split_across_prefill_chunks():
    """An image spanning where the budget would cut: the chunk ends before it, and the next one
    takes the whole image even past the budget; the output is the model's all the same."""
    from fastkv.cache.keys import ExtraKeys

    r = rig(dev=32, max_num_batched_tokens=8, long_prefill_token_threshold=0)
    image = ExtraKeys.of(mm_items=[{"start": 6, "end": 17, "hash": "ab" * 8}])
    r.add(0, range(1, 25), max_new_tokens=2, extra=image)
    assert seqs(r.step()) == [(0, 0, 6, False)]  # 8 would cut the image at 8: stop before it
    assert seqs(r.step()) == [(0, 6, 11, False)]  # the whole image [6, 17), 11 > the budget of 8
    assert seqs(r.step()) == [(0, 17, 7, True)]
    r.run()
    assert r.finished[0].output_token_ids == r.worker.truth[0].tokens[24:]
    plain = rig(dev=32, max_num_batched_tokens=8, long_prefill_token_threshold=0)
    plain.add(0, range(1, 25), max_new_tokens=2)
    assert seqs(plain.step()) == [(0, 0, 8, False)]  # without the item, the budget decides

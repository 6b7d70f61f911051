"""A sliding-window hybrid layout through the scheduler: one device pool and block table per KV
cache group (``fastkv.cache.group_manager``), the synthetic runner on real numpy caches whose
sliding layers have fewer blocks than the full ones.

The runner verifies every byte each group must still hold before every step, and its oracle reads
each group through its own table (a sliding group only its window), so a wrong or missing block in
any group changes the tokens; outputs must equal ``reference_output`` with the groups' windows.
Memory is tight enough that requests are preempted (recompute) and shared prefixes hit.
"""
import numpy as np
import pytest

from fastkv.cache.group_manager import GroupedManager
from fastkv.cache.manager import CacheConfig
from fastkv.cache.request_policy import CachePolicy
from fastkv.config import KVLayout, cdiv
from fastkv.engine import protocol
from fastkv.engine.runners.synthetic import KVMismatch, SyntheticRunner, reference_output
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from fastkv.sched.output import SeqWork, StepPlan
from tests.sched_harness import run_step

WINDOW = 6
LAYOUT = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=12, dtype="bfloat16", windows=(WINDOW, 0) * 2)
SYSTEM = [5, 9, 13, 17, 21, 25, 29, 33, 37]  # a shared prefix: hits across requests


def prompts(n: int = 8) -> list[list[int]]:
    return [(SYSTEM if i % 2 else []) + [(i * 31 + j * 7) % 90 + 1 for j in range(5 + 3 * i)] for i in range(n)]


def caches(group_blocks):
    blocks = LAYOUT.layer_blocks(group_blocks, 0)
    return ([np.zeros(LAYOUT.device_shape(n), LAYOUT.numpy_dtype) for n in blocks],
            [np.zeros(LAYOUT.device_shape(n), LAYOUT.numpy_dtype) for n in blocks])


def serve(group_blocks, max_new=12, chunk=16, n=8):
    k, v = caches(group_blocks)
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    cache = GroupedManager(CacheConfig(num_device_blocks=max(group_blocks), block_size=LAYOUT.block_size,
                                       layout=LAYOUT), group_blocks, chunk)
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=chunk, preemption=PreemptionMode.RECOMPUTE))
    ps = prompts(n)
    for rid, p in enumerate(ps):
        sched.add_request(Request(rid, np.array(p, np.int32), max_new))
    outputs, held = {}, [0, 0]
    sliding = [g for g, group in enumerate(LAYOUT.groups) if group.window]
    for _ in range(3000):
        if not sched.has_work():
            break
        out = sched.step()
        assert not out.copies
        run_step(sched, runner, out, outputs)
        sched.check_integrity()
        for rid in cache.request_ids():  # between steps: what each request holds per group
            for g, count in enumerate(cache.groups.held_blocks(rid)):
                held[g] = max(held[g], count)
    else:
        raise AssertionError("the scheduler did not finish")
    for r in sched.take_finished():
        outputs[r.request_id] = r.output_token_ids
    windows = [g.window for g in LAYOUT.groups]
    want = {rid: reference_output(p, max_new, 97, LAYOUT.dtype, windows=windows) for rid, p in enumerate(ps)}
    return outputs, want, sched, cache, runner, held, sliding


def test_outputs_equal_the_reference_under_recompute_preemption_with_a_bounded_sliding_group():
    bound = cdiv(WINDOW, LAYOUT.block_size) + 1
    # 12 blocks a group: the full group holds about one long request, the sliding group four
    outputs, want, sched, cache, runner, held, sliding = serve([12, 12])
    assert outputs == want
    assert sched.stats.preempt_recompute > 0 and sched.stats.recomputed_tokens > 0, "no preemption under pressure"
    assert runner.checks()["kv_blocks_verified"] > 0
    for g in sliding:
        assert 0 < held[g] <= bound, f"group {g} held {held[g]} blocks for one request between steps (bound {bound})"
        assert cache.peak_held[g] <= bound
    full = [g for g in range(len(LAYOUT.groups)) if g not in sliding]
    assert held[full[0]] > bound  # the full group holds whole contexts: the bound is the sliding group's alone
    summary = cache.group_summary()
    assert sum(s["hit_blocks"] for s in summary) > 0, "the shared prefix never hit"
    assert all(s["held"] == 0 for s in summary)  # everything let go at the end


def test_outputs_are_the_reference_with_room_to_spare():
    outputs, want, sched, *_ = serve([64, 64], chunk=8)
    assert outputs == want
    assert sched.stats.preempt_recompute == 0


def test_a_hole_in_a_sliding_table_that_the_window_reads_is_caught():
    """The check has teeth: a sliding group's table missing a block its window reads fails the
    step's validation; one pointing at another request's block fails the byte check."""
    k, v = caches([8, 8])
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    toks = np.arange(1, 11, dtype=np.int32)
    table = np.array([[0, 1, 2], [0, 1, 2]], np.int32)
    runner.step(StepPlan(1, [SeqWork(1, toks, 0, table, True)]))
    bad = table.copy()
    bad[0, 1] = -1  # position 10's window [5, 10] reads block 1
    with pytest.raises(ValueError, match="misses a block"):
        runner.step(StepPlan(2, [SeqWork(1, np.array([3], np.int32), 10, bad, True)]))
    moved = table.copy()
    moved[0, 1] = 5  # a block never written for this request
    with pytest.raises(KVMismatch, match="group 0"):
        runner.step(StepPlan(3, [SeqWork(1, np.array([3], np.int32), 10, moved, True)]))


class Overlap:
    """Steps as the engine plans them under async scheduling: the next plan goes out (through the
    wire, placeholders filled by the worker) while one is in flight."""

    def __init__(self, sched, runner) -> None:
        self.sched, self.runner, self.flight, self.last, self.overlapped = sched, runner, [], {}, 0

    def step(self, finished: dict) -> None:
        s = self.sched
        if not self.flight:
            self._plan(False, finished)
        if len(self.flight) == 1 and not s.sync_next:
            self._plan(True, finished)
        if self.flight:
            plan = protocol.fill_placeholders(self.flight.pop(0), self.last)
            out = self.runner.step(plan)
            self.last = out.sampled
            s.on_step_output(out)
            for r in s.take_finished():
                finished[r.request_id] = r.output_token_ids
            self.runner.release(r for r in list(finished) if r not in s.requests)

    def _plan(self, overlap: bool, finished: dict) -> None:
        out = self.sched.step(overlap)
        assert not out.copies
        for r in out.finished:
            finished[r.request_id] = r.output_token_ids
        if out.plan.seqs:
            self.overlapped += overlap
            self.flight.append(protocol.msg_to_plan(protocol.plan_to_msg(out.plan), len(LAYOUT.groups)))


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("seed", range(8))
def test_random_arrivals_aborts_and_cache_policies_keep_every_group_exact(seed, overlap):
    """Requests arrive over the run, some are aborted, some may not write or read the cache;
    budgets, prefill shares and device sizes vary; with ``overlap`` each step is planned while the
    one before runs (async scheduling). Every step checks the scheduler's and the group core's
    integrity and the runner verifies every byte; finished outputs are the reference."""
    rng = np.random.default_rng(seed)
    bound = cdiv(WINDOW, LAYOUT.block_size) + 1
    group_blocks = [int(rng.integers(bound + 3, 16)), int(rng.integers(9, 16))]
    chunk = int(rng.choice([4, 7, 12, 16]))
    k, v = caches(group_blocks)
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    cache = GroupedManager(CacheConfig(num_device_blocks=max(group_blocks), block_size=LAYOUT.block_size,
                                       layout=LAYOUT), group_blocks, chunk)
    cfg = SchedulerConfig(max_num_batched_tokens=chunk, preemption=PreemptionMode.RECOMPUTE,
                          max_num_seqs=int(rng.integers(2, 6)),
                          long_prefill_token_threshold=[None, 0, 3][int(rng.integers(3))])
    sched = Scheduler(cache, cfg)
    cap = group_blocks[1] * LAYOUT.block_size
    todo = []
    for rid in range(24):
        prompt = (SYSTEM[:int(rng.integers(0, len(SYSTEM) + 1))] if rng.random() < 0.6 else []) + \
            rng.integers(1, 90, int(rng.integers(1, 28))).tolist()
        max_new = int(rng.integers(1, 16))
        if len(prompt) + max_new >= cap:
            continue
        policy = [None, None, CachePolicy(write=False), CachePolicy(read=())][int(rng.integers(4))]
        todo.append(Request(rid, np.array(prompt, np.int32), max_new, cache_policy=policy))
    prompts_by_id = {r.request_id: r.prompt_token_ids.tolist() for r in todo}
    aborted, outputs = set(), {}
    rig = Overlap(sched, runner)
    for step in range(5000):
        if todo and rng.random() < 0.7:
            sched.add_request(todo.pop(0))
        if sched.requests and rng.random() < 0.05:
            rid = int(rng.choice(sorted(sched.requests)))
            if sched.abort(rid):
                aborted.add(rid)
        if not todo and not sched.has_work():
            break
        if overlap:
            rig.step(outputs)
        else:
            out = sched.step()
            assert not out.copies
            run_step(sched, runner, out, outputs)
        sched.check_integrity()
        if not overlap:  # between steps (with overlap the next step's blocks are taken already)
            for rid in cache.request_ids():
                for g, group in enumerate(LAYOUT.groups):
                    if group.window:
                        assert cache.groups.held_blocks(rid)[g] <= bound, f"step {step}: request {rid} over its bound"
    else:
        raise AssertionError("the scheduler did not finish")
    for r in sched.take_finished():
        outputs[r.request_id] = r.output_token_ids
    windows = [g.window for g in LAYOUT.groups]
    done = [rid for rid in outputs if rid not in aborted]
    assert done, "nothing finished"
    for rid in done:
        want = reference_output(prompts_by_id[rid], len(outputs[rid]), 97, LAYOUT.dtype, windows=windows)
        assert outputs[rid] == want, f"request {rid}"
    assert all(s["held"] == 0 for s in cache.group_summary())
    assert all(0 < s["max_held_per_request"] <= bound for s, g in zip(cache.group_summary(), LAYOUT.groups,
                                                                      strict=True) if g.window)
    assert (rig.overlapped > 0) is overlap


def test_a_multimodal_item_longer_than_the_budget_is_computed_in_one_step():
    """A step never splits an image (``batch._whole_items``): the hybrid's reservation covers a
    chunk as long as its longest item, so the request is not left waiting for a chunk it never fits."""
    from fastkv.cache.keys import ExtraKeys

    k, v = caches([24, 24])
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    cache = GroupedManager(CacheConfig(num_device_blocks=24, block_size=LAYOUT.block_size, layout=LAYOUT), [24, 24], 4)
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=4))
    prompt = list(range(1, 21))
    sched.add_request(Request(0, np.array(prompt, np.int32), 3, extra=ExtraKeys(mm=((2, 12, b"image-0"),))))
    outputs, chunks = {}, []
    for _ in range(100):
        if not sched.has_work():
            break
        out = sched.step()
        chunks += [len(s.token_ids) for s in out.plan.seqs]
        for r in out.finished:
            outputs[r.request_id] = r.output_token_ids
        if out.plan.seqs:
            sched.on_step_output(runner.step(out.plan))
        sched.check_integrity()
    assert 10 in chunks, chunks  # the item's 10 tokens in one step, past the budget of 4
    assert outputs[0] == reference_output(prompt, 3, 97, LAYOUT.dtype, windows=[g.window for g in LAYOUT.groups])


def test_a_request_no_sliding_group_can_hold_is_refused_in_one_line():
    """Admission counts blocks per group: a prompt whose prefill chunk needs more blocks of a
    sliding group than it has would wait forever, so it is refused when added."""
    cache = GroupedManager(CacheConfig(num_device_blocks=40, block_size=LAYOUT.block_size, layout=LAYOUT), [3, 40], 16)
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=16, preemption=PreemptionMode.RECOMPUTE))
    bound = LAYOUT.groups[0].max_blocks(LAYOUT.block_size, 16)
    with pytest.raises(ValueError, match=f"^request 0: a prefill chunk of 16 tokens needs {bound} blocks of the "
                                         f"sliding-window {WINDOW} KV cache group, which has 3$"):
        sched.add_request(Request(0, np.arange(1, 30, dtype=np.int32), 4))
    sched.add_request(Request(1, np.arange(1, 3, dtype=np.int32), 4))  # a chunk of 2 needs 3 blocks
    # the full group's bound is max_model_len, its blocks
    assert sched.max_model_len == 40 * LAYOUT.block_size

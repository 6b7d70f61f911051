"""Scheduler + cache manager as a state machine, against a fake worker and transfer layer.

Hypothesis interleaves requests, steps, step outputs, copy completions (in any order, some
failing), aborts, weight updates and prefilled (disaggregated) arrivals. After every rule:
``check_integrity()``, and exactness of restores: an offloaded request comes back with
exactly the tokens it had computed (fewer only from the first block a failed swap-in
spoiled), and the fake worker verifies before every step that each sequence reads slots
holding exactly its tokens (and token prefixes) at those positions. At the end, liveness:
with every copy and remote transfer completing, every request finishes.
"""
from __future__ import annotations

import random

import numpy as np
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.sched import PreemptionMode, Request, RequestState, Reservation, Scheduler, SchedulerConfig, WeightUpdate
from fastkv.sched.queues import QueuePolicy as Policy
from tests.sched_harness import FakeTransfer, FakeWorker, sample

BS = 4
VOCAB = 48
BASES = [list(range(100 + 20 * i, 100 + 20 * i + 12)) for i in range(3)]  # shared prefixes (3 blocks each)
S = RequestState


class SchedulerMachine(RuleBasedStateMachine):
    @initialize(
        dev=st.integers(6, 10),
        host=st.sampled_from([0, 4, 8, 16]),
        storage=st.booleans(),
        cache_policy=st.sampled_from(list(CachePolicy)),
        mode=st.sampled_from(list(PreemptionMode)),
        policy=st.sampled_from(list(Policy)),
        budget=st.sampled_from([3, 8, 16, 64]),
        chunked=st.booleans(),
        max_seqs=st.integers(1, 6),
        max_loading=st.sampled_from([None, 1, 3, 8]),
        patience=st.integers(1, 4),
        watermark_admission=st.booleans(),
        seed=st.integers(0, 2**32 - 1),
    )
    def setup(self, dev, host, storage, cache_policy, mode, policy, budget, chunked, max_seqs, max_loading,
              patience, watermark_admission, seed):
        self.rng = random.Random(seed)  # drives the end of the run: completion order and failures
        self.cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                              policy=cache_policy, storage=storage and host > 0))
        cfg = SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget, chunked_prefill=chunked,
                              preemption=mode, policy=policy, max_loading_blocks=max_loading,
                              copy_patience_steps=patience, watermark_admission=watermark_admission,
                              block_bytes=4096, reserve_init_blocks=2.0, reserve_decay=0.5, reserve_min_blocks=0.0)
        self.sched = Scheduler(self.cache, cfg)
        self.worker = FakeWorker(dev, BS, VOCAB)
        self.transfer = FakeTransfer(self.worker, host)
        self.output = None
        self.next_id = 0
        self.all_ids: set[int] = set()
        self.finished: dict[int, Request] = {}
        self.remote: list[tuple[int, Reservation]] = []  # writable reservations
        self.unwritable: dict[int, Reservation] = {}
        self.versions = 0
        self.offloaded: dict[int, tuple[int, int]] = {}  # rid -> (computed at offload, restores then)
        self.restoring: dict[int, tuple[int, int]] = {}  # rid -> (its restores, failures seen) when it began
        self.swap_in_failures: list[set[int]] = []

    # ------------------------------------------------------------------ helpers
    def _prompt(self, data) -> list[int]:
        base = data.draw(st.sampled_from(BASES))
        k = data.draw(st.integers(0, 3))
        tail = data.draw(st.lists(st.integers(1, VOCAB - 1), min_size=1, max_size=9))
        return base[:k * BS] + tail

    def _out(self, out) -> None:
        self.transfer.dispatch(out.copies)
        for rid in out.kv_writable:
            self.remote.append((rid, self.unwritable.pop(rid)))
        for r in out.finished:
            assert r.request_id not in self.finished, f"request {r.request_id} finished twice"
            assert r.is_finished
            self.finished[r.request_id] = r

    # ------------------------------------------------------------------ rules
    @rule(data=st.data(), max_new=st.integers(1, 12), mode=st.sampled_from([None, *PreemptionMode]),
          priority=st.integers(0, 2), eos=st.booleans())
    def add(self, data, max_new, mode, priority, eos):
        rid = self.next_id
        self.next_id += 1
        prompt = self._prompt(data)
        self.worker.add(rid, prompt)
        self.sched.add_request(Request(rid, np.array(prompt, np.int32), max_new, eos_token_id=0 if eos else None,
                                       priority=priority, preemption=mode))
        self.all_ids.add(rid)

    @precondition(lambda self: self.output is None)
    @rule()
    def step(self):
        out = self.sched.step()
        self._out(out)
        if out.plan.seqs:
            self.output = self.worker.step(out.plan, self.transfer.busy_device_blocks())

    @precondition(lambda self: self.output is not None)
    @rule()
    def deliver(self):
        out, self.output = self.output, None
        self.sched.on_step_output(out)

    @precondition(lambda self: self.transfer.pending)
    @rule(i=st.integers(0, 63), rolls=st.lists(st.integers(0, 4), min_size=1, max_size=4))
    def complete(self, i, rolls):
        for roll in rolls:  # a few completions, in any order; roll 0: the copy fails
            if not self.transfer.pending:
                return
            plan, ok = self.transfer.complete(i % len(self.transfer.pending), roll != 0)
            if plan.kind is CopyKind.SWAP_IN and not ok:
                self.swap_in_failures.append(set(plan.dst.tolist()))
            self.sched.on_copy_complete(plan, ok)
            self.integrity()

    @rule(i=st.integers(0, 63), go=st.integers(0, 3))
    def abort(self, i, go):
        live = sorted(self.sched.requests)
        if go == 3 and live:
            rid = live[i % len(live)]
            assert self.sched.abort(rid)

    @precondition(lambda self: self.sched.weight_update_state is WeightUpdate.NONE)
    @rule(go=st.integers(0, 9), drain=st.booleans())
    def begin_weight_update(self, go, drain):
        if go == 7:
            self.sched.begin_weight_update(drain=drain)

    @precondition(lambda self: self.sched.weight_update_state is WeightUpdate.READY)
    @rule()
    def finish_weight_update(self):
        self.versions += 1
        self.sched.finish_weight_update(f"w{self.versions}")

    @precondition(lambda self: self.output is None)
    @rule(data=st.data(), max_new=st.integers(2, 6))
    def reserve_prefilled(self, data, max_new):
        rid = self.next_id
        self.next_id += 1
        prompt = self._prompt(data)
        first = sample(rid, len(prompt), prompt[-1], VOCAB)
        req = Request(rid, np.array(prompt, np.int32), max_new, output_token_ids=[first])
        got = self.sched.reserve_for_prefilled(req)
        if isinstance(got, Reservation):
            assert got.last_position == len(prompt)
            self.worker.add(rid, prompt, [first])
            if got.writable:
                self.remote.append((rid, got))
            else:
                self.unwritable[rid] = got
            self.all_ids.add(rid)
        else:
            assert rid not in self.sched.requests and got.detail

    @precondition(lambda self: self.remote)
    @rule(i=st.integers(0, 63), roll=st.integers(0, 4))
    def prefilled_arrives(self, i, roll):
        rid, res = self.remote.pop(i % len(self.remote))
        if roll:  # 0: the transfer from the prefill instance failed
            self.worker.write(rid, res.block_table, res.first_position, res.last_position)
        else:
            self.worker.dev.spoil(res.block_table[res.first_position // BS:])
        self.sched.on_prefilled(rid, roll != 0)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def integrity(self):
        if not hasattr(self, "sched"):
            return
        self.sched.check_integrity()
        self._check_restores()

    def _check_restores(self):
        """An offloaded request resumes with exactly its computed tokens (short only from a block
        a failed swap-in spoiled); its slots are then checked by the worker at its next step."""
        for rid, req in self.sched.requests.items():
            st_ = req.state
            if st_ is S.OFFLOADING or st_ is S.OFFLOADED:
                rec = self.offloaded.setdefault(rid, (req.num_computed_tokens, req.num_restores))
                assert req.num_computed_tokens == rec[0], f"request {rid}: computed tokens changed while offloaded"
                self.offloaded[rid] = (rec[0], req.num_restores)  # again after a restore preempted while loading
            elif rid in self.offloaded:
                computed, restores = self.offloaded[rid]
                if st_ is S.WAITING:
                    del self.offloaded[rid]
                    self.restoring.pop(rid, None)
                    continue
                # more than one when a restore was preempted while loading and began again in one step
                assert req.num_restores > restores, f"request {rid} left OFFLOADED without a restore"
                if self.restoring.get(rid, (0, 0))[0] != req.num_restores:
                    self.restoring[rid] = (req.num_restores, len(self.swap_in_failures))
                if st_ is S.RUNNING:
                    table = self.cache.block_table(rid).tolist()
                    spoiled = set().union(*self.swap_in_failures[self.restoring.pop(rid)[1]:])
                    bad = [i for i, b in enumerate(table) if b in spoiled]
                    want = min(computed, bad[0] * BS) if bad else computed
                    assert req.num_computed_tokens == want, \
                        f"request {rid} restored with {req.num_computed_tokens} computed tokens, expected {want}"
                    del self.offloaded[rid]

    def teardown(self):
        if not hasattr(self, "sched"):
            return
        s = self.sched
        rng = self.rng
        for it in range(3000):
            # For a while copies complete late, out of order, some failing; then all succeed.
            unruly = it < 150
            if self.output is not None:
                self.deliver()
                self.integrity()
            pending = self.transfer.pending
            while pending and not (unruly and rng.random() < 0.3):
                i = rng.randrange(len(pending)) if unruly else 0
                plan, ok = self.transfer.complete(i, not (unruly and rng.random() < 0.15))
                if plan.kind is CopyKind.SWAP_IN and not ok:
                    self.swap_in_failures.append(set(plan.dst.tolist()))
                s.on_copy_complete(plan, ok)
                self.integrity()
            while self.remote:
                self.prefilled_arrives(0, 0 if unruly and rng.random() < 0.15 else 1)
                self.integrity()
            if s.weight_update_state is WeightUpdate.READY:
                self.finish_weight_update()
            if not s.has_work() and not self.transfer.pending:
                break
            self.step()
            self.integrity()
        stuck = {rid: r.state.name for rid, r in s.requests.items()}
        assert not stuck, f"requests never finished: {stuck}; {s.counts()}"
        assert set(self.finished) == self.all_ids, f"lost requests: {self.all_ids - set(self.finished)}"
        for rid, r in self.finished.items():
            if r.state is not S.FINISHED_ABORTED:
                assert r.output_token_ids == self.worker.truth[rid].tokens[r.num_prompt_tokens:], \
                    f"request {rid}: outputs differ from what the worker sampled"


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(stateful_step_count=80)  # examples: the profile's (500 in CI)

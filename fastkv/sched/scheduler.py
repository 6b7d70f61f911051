"""The scheduler: continuous batching over a CacheManager, with preemption that offloads.

It does no I/O and never waits. The engine drives it::

    sched.add_request(Request(...))              # any time
    out = sched.step()                           # -> SchedulerOutput
    transfer.dispatch(out.copies)                # copy plans to run now, asynchronously
    if out.plan.seqs: sched.on_step_output(workers.run(out.plan))
    for done in transfer.completions():          # any time, any order
        sched.on_copy_complete(done.plan_id, done.ok, done.nbytes, done.seconds)
    respond(out.finished)

One step plan is in flight at a time: ``step()`` refuses to run before the previous plan's
``on_step_output``, except ``step(overlap=True)`` (async scheduling): it plans the next step
while one is in flight. A request of the step in flight then goes on from where that step
ends; one that samples there decodes on a placeholder (``output.PLACEHOLDER``) the workers
fill in from their own sample, and the token reaches the scheduler with that step's output.
Requests in a step in flight are never preempted nor freed: a preemption that needs one
waits, and ``sync_next`` asks the engine to plan the step after next once nothing is in
flight; a request that stops in a step is finished when the steps in flight that still
compute for it are done (their work and tokens are discarded), so outputs are exactly the
synchronous ones. Copy completions may arrive whenever; a request waits for its own copies
in LOADING or OFFLOADING while the others keep running. A transfer layer that never answers
stalls only the requests whose copies it holds (those can still be aborted, and LOADING ones
preempted).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

from fastkv.cache.group_manager import GroupedManager
from fastkv.cache.manager import CacheManager
from fastkv.cache.plan import CopyKind, CopyPlan, Ready
from fastkv.sched import admission, preemption, reservation, weights
from fastkv.sched.batch import StepBatch
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.cost import CostModel
from fastkv.sched.hits import HitPolicy
from fastkv.sched.integrity import check
from fastkv.sched.outbox import CopyOutbox
from fastkv.sched.output import SchedulerOutput, SeqWork, StepOutput, StepPlan
from fastkv.sched.parts import SchedulerParts
from fastkv.sched.request import PreemptionMode, Request, RequestState
from fastkv.sched.reservation import Refusal, Reservation
from fastkv.sched.stats import SchedulerStats
from fastkv.sched.table import RequestTable
from fastkv.sched.weights import WeightUpdate

S = RequestState


class Scheduler:
    def __init__(self, cache: CacheManager, config: SchedulerConfig | None = None,
                 clock: Callable[[], float] = time.monotonic, hits: HitPolicy | None = None) -> None:
        if not isinstance(cache, CacheManager | GroupedManager):
            raise TypeError(f"cache must be a CacheManager or a GroupedManager, got {type(cache).__name__}")
        cfg = config if config is not None else SchedulerConfig()
        if not isinstance(cfg, SchedulerConfig):
            raise TypeError(f"config must be a SchedulerConfig, got {type(cfg).__name__}")
        self.cache = cache
        self.config = cfg
        self.clock = clock
        self.block_size = cache.block_size
        capacity = cache.config.num_device_blocks * self.block_size
        self.max_model_len = min(cfg.max_model_len or capacity, capacity)
        self.max_loading_blocks = cfg.max_loading_blocks or max(1, cache.config.num_device_blocks // 2)
        layout = cache.config.layout
        block_bytes = cfg.block_bytes or (layout.block_bytes if layout is not None else 0)
        if cfg.preemption is PreemptionMode.AUTO and not block_bytes:
            raise ValueError("auto preemption needs block_bytes (SchedulerConfig.block_bytes or a cache layout)")
        self.cost = CostModel(block_bytes, cfg.copy_bandwidth, cfg.prefill_rate, cfg.cost_alpha,
                              copy_latency=cfg.copy_latency_s)
        self.stats = SchedulerStats()
        self.table = table = RequestTable(cfg.policy, cfg.reserve_init_blocks, self.stats)
        self.outbox = CopyOutbox()
        # called with a finished request before its blocks are freed; returns copies of them to make
        # (a prefill engine exports the prompt for a decode engine: fastkv.engine.handoff)
        self.before_free: Callable[[Request], Iterable[CopyPlan]] | None = None
        # which host and storage hits admission loads (default: all, with no cost to judge by)
        self.hits = hits if hits is not None else HitPolicy(self.block_size)
        self._parts = SchedulerParts(cache, cfg, self.cost, table, self.outbox, self.max_model_len,
                                     self.max_loading_blocks, self.hits)
        # the table's, never rebound: what engines and tests read
        self.requests, self.waiting = table.requests, table.waiting
        self.loading, self.running, self.offloading = table.loading, table.running, table.offloading
        self.weight_update_state = WeightUpdate.NONE
        self._drain = True
        self._kv_writable: list[int] = []
        self._flight: list[StepPlan] = []  # out to the workers, oldest first (two with async scheduling)
        self._inflight_ids: set[int] = set()
        self.sync_next = False  # the last overlapped plan left a preemption waiting on the step in flight
        self._completed_since_step = 0  # copies completed since the last step()
        self._step_id = 0

    # ================================================================== engine API
    def add_request(self, request: Request) -> None:
        """Queue a new request. ValueError if its id is in use or it can never fit."""
        req = self._validate(request)
        if req.arrival_time is None:
            req.arrival_time = self.clock()
        self.table.add(req)

    def check_request(self, request: Request) -> None:
        """Raises as ``add_request`` would, without queueing (for a caller that holds it first)."""
        self._validate(request)

    def _validate(self, req: Request) -> Request:
        if not isinstance(req, Request):
            raise TypeError(f"expected a Request, got {type(req).__name__}")
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id} is already in use")
        if req.state is not S.WAITING or req.arrival_seq >= 0:
            raise ValueError(f"request {req.request_id} was already submitted (state {req.state.name})")
        if req.num_tokens >= self.max_model_len:
            raise ValueError(f"request {req.request_id}: {req.num_tokens} tokens leave no room to generate "
                             f"within max_model_len {self.max_model_len}")
        if why := self.cache.never_fits(req.num_prompt_tokens):  # a group too small for it (a hybrid's)
            raise ValueError(f"request {req.request_id}: {why}")
        mode = req.preemption if req.preemption is not None else self.config.preemption
        if mode is PreemptionMode.AUTO and not self.cost.block_bytes:
            raise ValueError(f"request {req.request_id}: auto preemption needs SchedulerConfig.block_bytes")
        return req

    def abort(self, request_id: int) -> bool:
        """Abort a request in any state; False if it is unknown or already finished. A request
        in the step now in flight, or receiving prefilled KV, is aborted once that is done."""
        req = self.requests.get(request_id)
        if req is None:
            return False
        if request_id in self._inflight_ids or req.remote_pending:
            req.abort_requested = True
            return True
        self._finish(req, S.FINISHED_ABORTED)
        return True

    def step(self, overlap: bool = False) -> SchedulerOutput:
        """Plan the next step: grow running requests (preempting when blocks run out), admit
        waiting ones, and hand out every copy plan produced since the last call. ``overlap``:
        one step is in flight and this plan follows it (module docstring)."""
        if self._flight and not (overlap and len(self._flight) == 1):
            raise ValueError(f"step() while step {self._flight[-1].step_id} is in flight: call on_step_output first")
        if overlap and self.weight_update_state is not WeightUpdate.NONE:
            raise ValueError("step(overlap=True) during a weight update: plan it after the step in flight")
        self._step_id += 1
        parts, batch = self._parts, StepBatch(self.cache, self.config)
        if self.weight_update_state is WeightUpdate.DRAINING and weights.progress(parts, batch, self._drain):
            self.weight_update_state = WeightUpdate.CLEARING
        updating = self.weight_update_state is not WeightUpdate.NONE
        pinned = {s.request_id: s for s in self._flight[-1].seqs} if self._flight else {}
        for req in list(self.running.values()):
            if batch.full:
                break
            if req.state is not S.RUNNING:
                continue
            seq = pinned.get(req.request_id)
            if seq is not None:
                self._follow(batch, req, seq)
            elif preemption.ensure_slots(parts, batch, req, updating, pinned):
                batch.schedule(req)
        if not updating:
            admission.admit(parts, batch)
        batch.top_up()
        seqs = list(batch.seqs.values())
        plan = StepPlan(self._step_id, seqs)
        self.sync_next = batch.need_sync
        if seqs:
            self._flight.append(plan)
            self._inflight_ids.update(s.request_id for s in seqs)
            self.stats.steps += 1
            reservation.decay_watermarks(self.table, self.config)
        elif self._completed_since_step:
            # an empty step while copies keep completing is the engine waiting on a live
            # transfer layer (it calls step() on every completion): that costs no patience.
            # Empty steps with no completion in between still count, so a transfer layer
            # that never completes cannot stall a request forever.
            for req in batch.stalled:
                req.stalled_steps -= 1
        self._completed_since_step = 0
        copies = self.outbox.hand_out()
        self.stats.copies += len(copies)
        writable, self._kv_writable = self._kv_writable, []
        return SchedulerOutput(plan, copies, self.table.take_finished(), writable)

    def _follow(self, batch: StepBatch, req: Request, seq: SeqWork) -> None:
        """Async scheduling: ``req`` goes on where its step in flight ends, unless it is sure
        to stop there. Its next slot may need a block: taken now, ahead of the token (the
        token is appended when the step in flight's output is in); when none is free, or the
        block taken must first be written back, it waits a step."""
        if req.abort_requested or req.finish_pending is not None:
            return
        if not seq.sample:  # a prefill chunk: its next one, slotted at admission
            batch.schedule(req, seq.end_pos)
            return
        pos = seq.end_pos
        if len(req.output_token_ids) + 1 >= req.max_new_tokens or req.num_tokens + 1 >= self.max_model_len:
            return
        if pos % self.block_size == 0 and not self.cache.takes_blocks_per_step:
            g = self.cache.append_slots(req.request_id, (), ahead=1)
            if g is None:
                return
            req.block_ahead = True
            self.outbox.emit(g.plans)
            if not g.ready:  # the block's old content is being written back first
                return
        batch.placeholder(req, pos)  # a hybrid's groups may have no room for it yet: then it waits

    def on_step_output(self, output: StepOutput) -> dict[int, int]:
        """The workers computed the oldest plan in flight: KV of the scheduled tokens is on the
        device; append sampled tokens and finish requests that stop. Returns the tokens
        appended (a request finished in an earlier step gets none)."""
        if not self._flight:
            raise ValueError("on_step_output without a step in flight")
        plan = self._flight[0]
        if not isinstance(output, StepOutput):
            raise TypeError(f"expected a StepOutput, got {type(output).__name__}")
        if output.step_id != plan.step_id:
            raise ValueError(f"output of step {output.step_id}, but step {plan.step_id} is in flight")
        missing = [s.request_id for s in plan.seqs if s.sample and s.request_id not in output.sampled]
        if missing:
            raise ValueError(f"step {plan.step_id}: no sampled token for requests {missing[:8]}")
        self._flight.pop(0)
        later = {s.request_id: s for s in self._flight[0].seqs} if self._flight else {}
        self._inflight_ids = set(later)
        now = self.clock()
        prefill = decode = 0
        applied: dict[int, int] = {}
        for seq in plan.seqs:
            req = self.requests[seq.request_id]
            if req.finish_pending is not None:  # stopped in the step before: this one's work is discarded
                if seq.request_id not in later:
                    self._finish(req, req.finish_pending)
                continue
            assert req.state is S.RUNNING and req.num_computed_tokens == seq.start_pos, \
                f"request {req.request_id} changed ({req.state.name}) while its step was in flight"
            end = seq.end_pos
            if seq.start_pos < req.max_computed:
                again = min(end, req.max_computed) - seq.start_pos
                req.num_recomputed_tokens += again
                self.stats.recomputed_tokens += again
            req.max_computed = max(req.max_computed, end)
            req.num_computed_tokens = end
            self.outbox.emit(self.cache.mark_computed(req.request_id, end))
            if len(seq.token_ids) > 1:
                prefill += len(seq.token_ids)
            else:
                decode += 1
            if seq.sample:
                tok = output.sampled[req.request_id]
                if not isinstance(tok, int) or tok < 0:
                    raise ValueError(f"request {req.request_id}: sampled token {tok!r} is not an int >= 0")
                req.append_output(tok)
                applied[req.request_id] = tok
                if req.first_token_time is None:
                    req.first_token_time = now
                nxt = later.get(req.request_id)
                ready = True
                if req.block_ahead or (nxt is not None and nxt.start_pos == req.num_tokens - 1):
                    # its slot was taken ahead of the token (async scheduling): the token is known now
                    g = self.cache.append_slots(req.request_id, req.token_span(req.num_slotted, req.num_tokens))
                    assert g is not None and not g.new_blocks and not g.plans, \
                        f"request {req.request_id}: a placeholder's slot needed a block"
                    req.num_slotted, req.block_ahead, ready = req.num_tokens, False, g.ready
                if tok == req.eos_token_id or tok in req.stop_token_ids:
                    self._finish_after(req, S.FINISHED_STOPPED, later)
                    continue
                if len(req.output_token_ids) >= req.max_new_tokens or req.num_tokens >= self.max_model_len:
                    self._finish_after(req, S.FINISHED_LENGTH, later)
                    continue
                if not ready and not req.abort_requested:  # the block it took ahead is still being written back
                    self.table.wait_for_write_back(req)
                    continue
            if req.abort_requested:
                self._finish_after(req, S.FINISHED_ABORTED, later)
        self.stats.prefill_tokens += prefill
        self.stats.decode_tokens += decode
        self.cost.observe_step(prefill, decode, output.seconds)
        return applied

    def _finish_after(self, req: Request, state: RequestState, later: dict[int, SeqWork]) -> None:
        """Finish ``req`` now, or once the step in flight that still computes for it is done."""
        if req.request_id in later:
            req.finish_pending = state
        else:
            self._finish(req, state)

    def on_copy_complete(self, plan: CopyPlan | int, ok: bool, nbytes: int = 0, seconds: float = 0.0) -> None:
        """A copy plan finished on every rank (``ok``) or failed. ``nbytes``/``seconds`` (per
        rank) feed the bandwidth estimate; ``seconds`` 0: not a measure of the copy (a layered
        SWAP_IN is acked before it copies)."""
        pid = plan if isinstance(plan, int) else getattr(plan, "plan_id", None)
        p = self.outbox.complete(pid)
        if p is None:
            raise ValueError(f"plan {plan!r} is not in flight from this scheduler (never dispatched, or completed)")
        self._completed_since_step += 1
        if not ok:
            self.stats.copies_failed += 1
        elif nbytes and seconds > 0 and p.kind in (CopyKind.SWAP_IN, CopyKind.SWAP_OUT):  # an offload's (not storage)
            self.cost.observe_copy(nbytes, seconds)
        if ok and nbytes and seconds > 0 and p.kind in (CopyKind.SWAP_IN, CopyKind.LOAD):  # a hit's copy here
            self.hits.observe(p.kind is CopyKind.LOAD, nbytes, seconds)
        c = self.cache.complete(p, bool(ok))
        if p.kind is CopyKind.CLEAR:
            assert self.weight_update_state is WeightUpdate.CLEARING, "CLEAR completed outside a weight update"
            self.weight_update_state = WeightUpdate.READY
        self.outbox.emit(c.plans)
        for r in c.ready:
            self._loaded(r)
        updating = self.weight_update_state is not WeightUpdate.NONE
        for rid in c.offloaded:
            req = self.requests[rid]
            self.table.offloaded(req)
            preemption.offload_done(self._parts, req, updating)
        for rid in c.offload_failed:  # still on its device blocks; the pressure remains: recompute
            self.stats.offload_failed += 1
            self.cache.free(rid, cache=True)
            self.table.to_waiting(self.requests[rid], S.OFFLOADING)

    def take_finished(self) -> list[Request]:
        """The requests finished since the last ``step()`` (which hands out the rest): the engine
        reports one with the step that sampled its last token."""
        return self.table.take_finished()

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        self.cost.observe_copy(nbytes, seconds)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.cost.observe_prefill(tokens, seconds)

    def has_work(self) -> bool:
        """Requests unfinished, copies to hand out or in flight, or a step to report."""
        return bool(self.requests or self.outbox or self.table.finished or self._kv_writable
                    or self._flight)

    def check_integrity(self) -> None:
        check(self._parts, self._flight, self.weight_update_state)

    # ================================================================== disaggregated decode
    def reserve_for_prefilled(self, request: Request, tail_key: bytes | None = None) -> Reservation | Refusal:
        """Blocks for a request prefilled on another instance, or a refusal with its reason.
        ``tail_key``: its KV is in the storage tier, the partial block under that key
        (``fastkv.cache.handoff``); what storage holds is loaded here, so the remote part shrinks."""
        req = self._validate(request)
        if self._flight:
            raise ValueError("reserve_for_prefilled while a step is in flight: call it between steps")
        if req.arrival_time is None:
            req.arrival_time = self.clock()
        return reservation.reserve(self._parts, req, self.weight_update_state is not WeightUpdate.NONE, tail_key)

    def on_prefilled(self, request_id: int, ok: bool) -> None:
        """The remote KV of a reserved request arrived (``ok``) or its transfer failed."""
        req = self.requests.get(request_id)
        if req is None or not req.remote_pending or req.local_computed < 0:
            raise ValueError(f"request {request_id} is not waiting for prefilled KV (or its blocks were not "
                             f"writable yet)")
        req.remote_pending = False
        if req.abort_requested:
            self._finish(req, S.FINISHED_ABORTED)
        elif not ok:
            self.stats.load_shortfalls += 1
            self.cache.free(request_id, cache=True)
            self.table.load_failed(req)
        else:
            self._prefilled_ready(req, req.local_computed)

    # ================================================================== weight update
    def begin_weight_update(self, drain: bool = True) -> None:
        """Pause admission. ``drain``: let requests on the device finish; else preempt them all
        (recompute). Offloaded KV belongs to the old weights: those requests recompute. Once
        nothing holds blocks and no copy is in flight, a CLEAR plan goes out; when it completes
        ``weight_update_state`` is READY."""
        if self.weight_update_state is not WeightUpdate.NONE:
            raise ValueError(f"weight update already in progress ({self.weight_update_state.name})")
        self.weight_update_state = WeightUpdate.DRAINING
        self._drain = bool(drain)

    def finish_weight_update(self, weights_version: str) -> None:
        """New weights are loaded: new cache namespace, admission resumes (a RESTORE plan goes out)."""
        if self.weight_update_state is not WeightUpdate.READY:
            raise ValueError(f"finish_weight_update in state {self.weight_update_state.name}, expected READY")
        self.outbox.emit([self.cache.finish_weight_update(weights_version)])
        self.weight_update_state = WeightUpdate.NONE

    # ================================================================== internals
    def _loaded(self, ready: Ready) -> None:
        req = self.requests[ready.request_id]
        if req.state is S.RUNNING and req.block_ahead:
            return  # the write-back of the block it took ahead is done before its step's output (async)
        n = ready.num_computed_tokens
        if req.prefilled:
            req.local_computed = n
            if req.remote_pending:
                self._kv_writable.append(req.request_id)
            else:
                self._prefilled_ready(req, n)
            return
        if n < req.load_target:
            self.stats.load_shortfalls += 1
        self.table.start_running(req, n, S.LOADING)

    def _prefilled_ready(self, req: Request, local: int) -> None:
        """Local copies and remote KV are both in: decode from the last known token."""
        computed = local
        if local >= req.remote_start:
            computed = req.num_tokens - 1
            self.outbox.emit(self.cache.mark_computed(req.request_id, computed))
        else:
            self.stats.load_shortfalls += 1  # a local load failed: recompute from there
        req.prefilled = False
        req.max_computed = max(req.max_computed, computed)
        self.table.start_running(req, computed, S.LOADING)

    def _finish(self, req: Request, state: RequestState) -> None:
        if self.before_free is not None and req.state.in_cache and state is not S.FINISHED_ABORTED:
            self.outbox.emit(self.before_free(req))
        if req.state.in_cache:
            self.cache.free(req.request_id, cache=True)
        self.table.finish(req, state, self.clock())

    def reset_watermarks(self) -> None:
        self.table.reset_watermarks()

    def growth_reservation(self) -> int:
        """What ``reserve_for_prefilled`` holds back for the requests holding blocks."""
        return reservation.growth_reservation(self._parts, self.config.overcommit_growth)

    # ================================================================== introspection
    def get_request(self, request_id: int) -> Request | None:
        return self.requests.get(request_id)

    def counts(self) -> dict[str, int]:
        offloaded = sum(1 for r in self.waiting if r.state is S.OFFLOADED)
        return {"waiting": len(self.waiting) - offloaded, "loading": len(self.loading), "running": len(self.running),
                "offloading": len(self.offloading), "offloaded": offloaded,
                "copies_in_flight": len(self.outbox.in_flight)}

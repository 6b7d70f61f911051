"""check_integrity() across the scheduler and its cache manager, recomputed from scratch.

Slow (linear in requests, blocks and copies): for tests and debugging, after every step."""
from __future__ import annotations

from typing import TYPE_CHECKING

from fastkv.cache.requests import ReqState
from fastkv.config import cdiv
from fastkv.sched.request import RequestState
from fastkv.sched.weights import WeightUpdate

if TYPE_CHECKING:
    from fastkv.sched.output import StepPlan
    from fastkv.sched.parts import SchedulerParts

S = RequestState
_CACHE_STATE = {S.LOADING: ReqState.RUNNING, S.RUNNING: ReqState.RUNNING, S.OFFLOADING: ReqState.OFFLOADING,
                S.OFFLOADED: ReqState.OFFLOADED}


def check(p: SchedulerParts, inflight: list[StepPlan], update: WeightUpdate) -> None:
    """``inflight``: the step plans out to the workers; ``update``: the weight update's state."""
    cache, bs, table = p.cache, p.block_size, p.table
    cache.check_integrity()
    groups = {S.LOADING: table.loading, S.RUNNING: table.running, S.OFFLOADING: table.offloading}
    waiting = {r.request_id for r in table.waiting}
    for rid, req in table.requests.items():
        st = req.state
        assert req.request_id == rid, f"request {rid}: filed under another id"
        assert not st.is_finished and st is not S.PREEMPTED, f"request {rid}: {st.name} outside a scheduler call"
        for gst, group in groups.items():
            assert (rid in group) == (st is gst), f"request {rid} is {st.name} but {'not ' * (st is gst)}in " \
                                                  f"the {gst.name} set"
        assert (rid in waiting) == (st in (S.WAITING, S.OFFLOADED)), f"request {rid}: {st.name}, queued: " \
                                                                     f"{rid in waiting}"
        assert 0 <= req.num_computed_tokens <= req.num_tokens, f"request {rid}: computed {req.num_computed_tokens} " \
                                                               f"of {req.num_tokens} tokens"
        assert req.num_tokens == req.num_prompt_tokens + len(req.output_token_ids)
        assert req.remote_pending <= (st is S.LOADING and req.prefilled), f"request {rid}: remote KV while {st.name}"
        if st is S.WAITING:
            assert req.num_computed_tokens == 0 and req.num_slotted == 0, f"request {rid}: WAITING with KV"
            continue
        cst = cache.request_state(rid)
        assert cst is _CACHE_STATE[st], f"request {rid} is {st.name}, the cache says {cst.name}"
        assert req.num_slotted <= req.num_tokens <= req.num_slotted + 1, \
            f"request {rid}: {req.num_slotted} slotted of {req.num_tokens} tokens"
        if st is S.OFFLOADED:
            assert cache.num_computed_tokens(rid) == req.num_computed_tokens, f"request {rid}: offloaded tokens"
            continue
        blocks = cache.block_table(rid)
        assert blocks.ndim == 2 or len(blocks) == cdiv(req.num_slotted, bs), \
            f"request {rid}: {len(blocks)} blocks for {req.num_slotted} slotted tokens"  # 2-D: taken per step
        cache.check_request(rid)
        if st is S.RUNNING:
            assert cache.is_ready(rid), f"request {rid}: RUNNING but its copies are pending"
            assert cache.num_computed_tokens(rid) == req.num_computed_tokens, \
                f"request {rid}: computed {req.num_computed_tokens}, the cache says {cache.num_computed_tokens(rid)}"
            assert req.num_computed_tokens < req.num_tokens, f"request {rid}: RUNNING with nothing to compute"
            assert req.relief_blocks == 0
        elif st is S.LOADING:
            assert req.prefilled or not cache.is_ready(rid), f"request {rid}: LOADING but its copies are done"
        else:
            assert req.relief_blocks > 0, f"request {rid}: OFFLOADING releases no blocks"
    assert len(table.requests) == len(waiting) + sum(len(g) for g in groups.values()), "a request in two places"
    in_cache = {rid for rid, r in table.requests.items() if r.state.in_cache}
    assert set(cache.request_ids()) == in_cache, f"cache requests {sorted(cache.request_ids())} != " \
                                                 f"scheduler's {sorted(in_cache)}"
    plans = p.outbox.plan_ids()
    assert len(plans) == len(set(plans)), "a copy plan both queued and dispatched"
    open_copies = cache.copies_in_flight()
    assert set(plans) == open_copies, f"plans in flight {sorted(plans)} != the cache's open copies " \
                                      f"{sorted(open_copies)}"
    for plan in inflight:
        for seq in plan.seqs:
            req = table.requests.get(seq.request_id)
            assert req is not None and req.state is S.RUNNING, f"request {seq.request_id} left its in-flight step"
    for req in table.requests.values():
        assert req.finish_pending is None or any(req.request_id in {s.request_id for s in plan.seqs}
                                                 for plan in inflight), \
            f"request {req.request_id}: stopped, but no step in flight holds it back"
    if update in (WeightUpdate.CLEARING, WeightUpdate.READY):
        assert not in_cache, f"weight update {update.name} with requests in the cache: {in_cache}"

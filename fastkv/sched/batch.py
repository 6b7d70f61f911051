"""One step's batch while ``step()`` builds it: the sequences scheduled, the token budget
left, and the requests that stalled (their patience is refunded if the step stays empty).

Fair chunked prefill: a prefill chunk first gets at most ``SchedulerConfig.prefill_share``
tokens, so that the requests scheduled after it (decodes, other prefills, the newcomers that
admission adds) find budget left; once everyone had theirs, ``top_up`` gives what is left to the
prefills held back, shortest rest first. A long prompt therefore progresses every step, by a whole step's
budget when it runs alone, and a short prompt arriving beside it is admitted in the next step."""
from __future__ import annotations

import numpy as np

from fastkv.cache.manager import CacheManager
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.output import PLACEHOLDER, SeqWork
from fastkv.sched.request import Request


class StepBatch:
    def __init__(self, cache: CacheManager, config: SchedulerConfig) -> None:
        self.cache = cache
        self.config = config
        self.budget = config.max_num_batched_tokens
        self.seqs: dict[int, SeqWork] = {}
        self.stalled: list[Request] = []
        self.share = config.prefill_share
        self.held_back: list[Request] = []  # prefills cut to their share, in schedule order
        # async scheduling: where a request in the step in flight goes on from (its KV below is being computed)
        self.starts: dict[int, int] = {}
        self.need_sync = False  # a preemption had to wait for the step in flight: plan the next one after it

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.seqs) >= self.config.max_num_seqs

    def _rest(self, req: Request) -> int:
        return req.num_tokens - self.starts.get(req.request_id, req.num_computed_tokens)

    def schedule(self, req: Request, start: int | None = None) -> None:
        """Put RUNNING ``req``'s next chunk in this step, as far as the budget allows.
        ``start``: the step in flight computes its tokens below (async scheduling)."""
        if start is not None:
            self.starts[req.request_id] = start
        n = self._rest(req)
        assert n > 0, f"request {req.request_id} is RUNNING with nothing to compute"
        cfg = self.config
        if n > self.budget and not cfg.chunked_prefill and n <= cfg.max_num_batched_tokens:
            return  # a whole prompt in a later step (one longer than the budget is chunked anyway)
        n = min(n, self.budget)
        if self.share and n > self.share:
            n = self.share
            self.held_back.append(req)
        self._put(req, n)

    def top_up(self) -> None:
        """Give the budget nobody else took to the prefills cut to their share, the one nearest
        its first token first (a short prompt's TTFT is decided by it, a long one's hardly)."""
        for req in sorted(self.held_back, key=self._rest):
            if self.budget <= 0:
                return
            seq = self.seqs.get(req.request_id)
            if seq is None:  # unscheduled (preempted) after it was cut
                continue
            n = len(seq.token_ids)
            more = min(self._rest(req) - n, self.budget)
            if more > 0:
                self.budget += n
                self._put(req, n + more)

    def placeholder(self, req: Request, pos: int) -> None:
        """Decode ``req`` at ``pos`` on the token the step in flight samples for it (async
        scheduling): the worker fills the placeholder in from its own sample. Not when a KV cache
        group has no room for it yet (``group_manager``): it waits for the step after."""
        table = self.cache.step_table(req.request_id, pos, 1)
        if table is None:
            return
        self.seqs[req.request_id] = SeqWork(req.request_id, np.array([PLACEHOLDER], np.int32), pos, table, True)
        self.budget -= 1

    def _put(self, req: Request, n: int) -> None:
        start = self.starts.get(req.request_id, req.num_computed_tokens)
        n = _whole_items(req, start, n)
        table = self.cache.step_table(req.request_id, start, n)
        if table is None:  # a KV cache group has no room for the chunk now (group_manager): it waits
            kept = self.seqs.get(req.request_id)  # top_up's smaller chunk, whose budget it gave back
            if kept is not None:
                self.budget -= len(kept.token_ids)
            return
        self.seqs[req.request_id] = SeqWork(req.request_id, req.token_span(start, start + n), start, table,
                                            start + n == req.num_tokens)
        self.budget -= n

    def unschedule(self, req: Request) -> None:
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None:
            self.budget += len(seq.token_ids)


def _whole_items(req: Request, start: int, n: int) -> int:
    """``n``, moved so that the chunk ``[start, start + n)`` splits no multimodal item: it ends
    before an item it would cut, or, when it starts at one, takes the whole item even past the
    budget (an image's tokens are computed in one step, as FastDeploy does)."""
    if req.extra is None or not req.extra.mm:
        return n
    end = start + n
    for first, last, _ in sorted(req.extra.mm):  # in start order
        if first < end < last:
            end = first if first > start else last
    return end - start

"""One step's batch while ``step()`` builds it: the sequences scheduled, the token budget
left, and the requests that stalled (their patience is refunded if the step stays empty)."""
from __future__ import annotations

from fastkv.cache.manager import CacheManager
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.output import SeqWork
from fastkv.sched.request import Request


class StepBatch:
    def __init__(self, cache: CacheManager, config: SchedulerConfig) -> None:
        self.cache = cache
        self.config = config
        self.budget = config.max_num_batched_tokens
        self.seqs: dict[int, SeqWork] = {}
        self.stalled: list[Request] = []

    @property
    def full(self) -> bool:
        return self.budget <= 0 or len(self.seqs) >= self.config.max_num_seqs

    def schedule(self, req: Request) -> None:
        """Put RUNNING ``req``'s next chunk in this step, as far as the budget allows."""
        n = req.num_new_tokens
        assert n > 0, f"request {req.request_id} is RUNNING with nothing to compute"
        cfg = self.config
        if n > self.budget and not cfg.chunked_prefill and n <= cfg.max_num_batched_tokens:
            return  # a whole prompt in a later step (one longer than the budget is chunked anyway)
        n = min(n, self.budget)
        start = req.num_computed_tokens
        self.seqs[req.request_id] = SeqWork(
            req.request_id, req.token_span(start, start + n), start, self.cache.block_table(req.request_id),
            start + n == req.num_tokens)
        self.budget -= n

    def unschedule(self, req: Request) -> None:
        seq = self.seqs.pop(req.request_id, None)
        if seq is not None:
            self.budget += len(seq.token_ids)

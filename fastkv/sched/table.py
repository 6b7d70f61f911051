"""The request table: every unfinished request, filed by state, and the one caller of ``move``.

Each transition keeps the filing in step with the state: WAITING and OFFLOADED requests are in
the waiting queue, LOADING, RUNNING and OFFLOADING ones in their dict, PREEMPTED (inside one
scheduler call) nowhere. The role modules decide; the table moves.
"""
from __future__ import annotations

from fastkv.sched.queues import QueuePolicy, WaitingQueue
from fastkv.sched.request import Request, RequestState, move
from fastkv.sched.stats import SchedulerStats

S = RequestState


class RequestTable:
    def __init__(self, policy: QueuePolicy, reserve_init_blocks: float, stats: SchedulerStats) -> None:
        self.requests: dict[int, Request] = {}  # every unfinished request
        self.waiting = WaitingQueue(policy)  # WAITING and OFFLOADED
        self.loading: dict[int, Request] = {}
        self.running: dict[int, Request] = {}
        self.offloading: dict[int, Request] = {}
        self.finished: list[Request] = []  # since the last take_finished
        self.stats = stats
        self._reserve_init = reserve_init_blocks
        self._groups = {S.LOADING: self.loading, S.RUNNING: self.running, S.OFFLOADING: self.offloading}
        self._arrivals = 0
        self._admissions = 0

    def _move(self, req: Request, dst: RequestState, *expected: RequestState) -> None:
        src = req.state
        move(req, dst, *expected)
        rid, groups = req.request_id, self._groups
        if src is S.WAITING or src is S.OFFLOADED:
            self.waiting.remove(req)
        elif src in groups:
            del groups[src][rid]
        if dst is S.WAITING or dst is S.OFFLOADED:
            self.waiting.push(req)
        elif dst in groups:
            groups[dst][rid] = req

    def _count_admission(self, req: Request) -> None:
        req.admit_seq = self._admissions
        self._admissions += 1
        req.watermark = self._reserve_init
        self.stats.admitted += 1

    @property
    def num_holding(self) -> int:
        """Requests on the device: what ``max_num_seqs`` bounds."""
        return len(self.running) + len(self.loading)

    # ================================================================== arrivals and admission
    def add(self, req: Request) -> None:
        """A new request, queued WAITING."""
        req.arrival_seq = self._arrivals
        self._arrivals += 1
        self.requests[req.request_id] = req
        self.waiting.push(req)

    def admit(self, req: Request) -> None:
        """A queued request got its blocks; ``start_running`` or ``start_loading`` follows."""
        self._count_admission(req)

    def admit_prefilled(self, req: Request) -> None:
        """A new request admitted at once with reserved blocks (disaggregated decode);
        ``start_loading`` follows."""
        self.add(req)
        self._count_admission(req)

    def start_loading(self, req: Request, target: int, *expected: RequestState) -> None:
        self._move(req, S.LOADING, *expected)
        req.load_target = target

    def start_running(self, req: Request, computed: int, *expected: RequestState) -> None:
        self._move(req, S.RUNNING, *expected)
        req.num_computed_tokens = computed

    def wait_for_write_back(self, req: Request) -> None:
        """RUNNING ``req`` took a block still being written back: LOADING until that copy is done."""
        self._move(req, S.LOADING, S.RUNNING)
        req.load_target = req.num_computed_tokens

    # ================================================================== preemption
    def preempt(self, req: Request) -> None:
        """PREEMPTED (transient): the caller moves it on by mode. Every watermark resets."""
        self._move(req, S.PREEMPTED, S.RUNNING, S.LOADING)
        req.num_preemptions += 1
        self.reset_watermarks()

    def start_offloading(self, req: Request, relief_blocks: int) -> None:
        self._move(req, S.OFFLOADING, S.PREEMPTED)
        req.relief_blocks = relief_blocks

    def offloaded(self, req: Request) -> None:
        """Its KV is on the host: queued for its restore."""
        self._move(req, S.OFFLOADED, S.PREEMPTED, S.OFFLOADING)
        req.relief_blocks = 0

    def to_waiting(self, req: Request, *expected: RequestState) -> None:
        """Back to the queue with no KV: it will be recomputed (reusing cached prefixes)."""
        self._move(req, S.WAITING, *expected)
        req.relief_blocks = 0
        req.num_computed_tokens = 0
        req.num_slotted = 0
        req.prefilled = False
        req.local_computed = -1

    def load_failed(self, req: Request) -> None:
        """A LOADING request whose KV will not arrive: recompute it."""
        self._move(req, S.PREEMPTED, S.LOADING)
        self.to_waiting(req, S.PREEMPTED)

    # ================================================================== the end
    def finish(self, req: Request, state: RequestState, now: float) -> None:
        self._move(req, state, req.state)
        req.finish_time = now
        del self.requests[req.request_id]
        self.finished.append(req)
        self.stats.finished += 1
        if state is S.FINISHED_ABORTED:
            self.stats.aborted += 1

    def take_finished(self) -> list[Request]:
        finished, self.finished = self.finished, []
        return finished

    def reset_watermarks(self) -> None:
        for group in (self.running, self.loading):
            for r in group.values():
                r.watermark = self._reserve_init

"""Scheduler knobs, with the reasons for their defaults."""
from __future__ import annotations

from dataclasses import dataclass

from fastkv.sched.queues import QueuePolicy
from fastkv.sched.request import PreemptionMode


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 128  # sequences per step (and admitted at once, LOADING included)
    max_num_batched_tokens: int = 2048  # tokens computed per step
    chunked_prefill: bool = True  # split prompts across steps to fit the token budget
    # Fair chunked prefill: one request's prefill chunk takes at most this many tokens of a step
    # before the other requests (decodes, other prefills, newcomers) had theirs; budget they leave
    # goes back to it, so a long prompt alone still fills every step. None: a quarter of
    # max_num_batched_tokens (newcomers and decodes get three quarters of a step beside a long
    # prompt). vLLM and FastDeploy default to 4 % of max_model_len, which a device sized for one long
    # prompt makes larger than the step budget, i.e. no cap; 0: no cap.
    long_prefill_token_threshold: int | None = None
    max_model_len: int | None = None  # prompt + output cap; None: what the whole device holds
    preemption: PreemptionMode = PreemptionMode.RECOMPUTE  # deployment default (requests may override)
    policy: QueuePolicy = QueuePolicy.FCFS  # queue order and victim choice
    # Liveness: device blocks held by LOADING requests with host/storage prefix hits are capped,
    # so copies that are slow (or never complete) cannot take the device from admission.
    max_loading_blocks: int | None = None  # None: half the device
    # A request that cannot grow waits this many steps for in-flight offloads to free blocks,
    # then preempts more victims by recompute (a transfer layer that stalls cannot stall it).
    copy_patience_steps: int = 16
    # Disaggregated decode: a prefilled request is taken only if the free blocks cover it beyond
    # all the running requests can still need (their growth to max_new_tokens), so taking it never
    # preempts them. overcommit_growth: hold back only FastDeploy's watermark instead, per running
    # request reserve_init_blocks, decaying by reserve_decay per step down to reserve_min_blocks, reset
    # by a preemption: more requests run at once, and one is preempted when its growth outruns that.
    overcommit_growth: bool = False
    reserve_init_blocks: float = 4.0
    reserve_decay: float = 0.9
    reserve_min_blocks: float = 1.0
    watermark_admission: bool = False  # also hold the watermarks back from local admission
    # Local admission by reserve_for_prefilled's rule (the growth of every request holding blocks, and
    # the newcomer's own, held back): what a decode engine (--role decode) admits never preempts.
    growth_admission: bool = False
    # Auto preemption: priors for the cost model, replaced by measurements.
    block_bytes: int | None = None  # None: the cache layout's block_bytes
    copy_bandwidth: float = 16e9  # bytes / s
    prefill_rate: float = 8000.0  # tokens / s
    copy_latency_s: float = 1e-4  # per copy task: the order of bench_swap's empty task round trip on a CPU
    cost_alpha: float = 0.2

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "copy_patience_steps"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"SchedulerConfig.{name} must be an int >= 1, got {v!r}")
        v = self.long_prefill_token_threshold
        if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 0):
            raise ValueError(f"SchedulerConfig.long_prefill_token_threshold must be None or an int >= 0, got {v!r}")
        for name in ("max_model_len", "max_loading_blocks", "block_bytes"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ValueError(f"SchedulerConfig.{name} must be None or an int >= 1, got {v!r}")
        object.__setattr__(self, "preemption", PreemptionMode(self.preemption))
        object.__setattr__(self, "policy", QueuePolicy(self.policy))
        if not 0 <= self.reserve_min_blocks <= self.reserve_init_blocks:
            raise ValueError("SchedulerConfig: need 0 <= reserve_min_blocks <= reserve_init_blocks")
        if not 0 < self.reserve_decay <= 1:
            raise ValueError(f"SchedulerConfig.reserve_decay must be in (0, 1], got {self.reserve_decay}")
        if min(self.copy_bandwidth, self.prefill_rate) <= 0 or not 0 < self.cost_alpha <= 1 or self.copy_latency_s < 0:
            raise ValueError("SchedulerConfig: copy_bandwidth and prefill_rate must be > 0, cost_alpha in (0, 1], "
                             "copy_latency_s >= 0")

    @property
    def prefill_share(self) -> int:
        """Tokens one prefill chunk takes before the others had theirs (0: no cap)."""
        if not self.chunked_prefill:
            return 0
        v = self.long_prefill_token_threshold
        return max(1, self.max_num_batched_tokens // 4) if v is None else v

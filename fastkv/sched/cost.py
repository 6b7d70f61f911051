"""Online estimates that decide ``auto`` preemption: copy bandwidth and prefill rate.

Offloading a victim costs two copies of the blocks it has no host copy of (out now, in at
resume); recomputing it costs a prefill of the tokens after its host-copied prefix (what
``CacheManager.preemption_work`` counts: both modes swap the host-copied blocks back in).
Both rates are exponentially weighted moving averages of what the engine measured
(``observe_copy`` from transfer completions, ``observe_step`` from steps), starting from
configured priors.

A step costs a floor whatever its prefill (a decode step reads all the weights: on a GPU the
prefill tokens of a mixed step ride on it), so the prefill rate is the marginal one: a
prefill step's tokens over its time beyond the floor, which decode-only steps measure.
Tokens per whole step would put the rate an order of magnitude low under a roofline model
and make every recompute look expensive.

A copy also costs a fixed ``copy_latency`` per task (the transfer path's round trip, which
bench_swap measures as ``empty_task_rtt_us``): that is what makes the choice depend on the
victim's context. A short context recomputes in less time than two round trips; a long one
copies faster than it recomputes. The bandwidth estimate leaves the latency out. Once tasks of
different sizes were seen, both come from a least-squares line through them (seconds = latency
+ bytes / bandwidth, over exponentially weighted moments): tasks of a few blocks take mostly
latency, and charging it all to bandwidth put the bandwidth ~50x low and every offload too dear.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class CostModel:
    block_bytes: int  # bytes of one block on one rank (all layers, K and V); 0: unknown
    copy_bandwidth: float  # bytes / second, host <-> device, per rank
    prefill_rate: float  # tokens / second of prefill compute
    alpha: float = 0.2  # weight of a new measurement
    copy_samples: int = 0
    prefill_samples: int = 0
    copy_latency: float = 0.0  # seconds per copy task, whatever its size
    step_floor: float = 0.0  # seconds of a decode-only step (EWMA)
    floor_samples: int = 0
    # EWMA moments of copy tasks' (bytes, seconds): mean x, mean y, mean x^2, mean x*y
    _moments: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    _task_samples: int = 0

    def __post_init__(self) -> None:
        if self.copy_bandwidth <= 0 or self.prefill_rate <= 0 or not 0 < self.alpha <= 1 or self.copy_latency < 0:
            raise ValueError(f"CostModel: bandwidth {self.copy_bandwidth} and prefill rate {self.prefill_rate} "
                             f"must be > 0, alpha {self.alpha} in (0, 1] and copy latency {self.copy_latency} >= 0")

    def observe_copy(self, nbytes: int, seconds: float) -> None:
        if nbytes < 0 or seconds < 0:
            raise ValueError(f"observe_copy: negative bytes {nbytes} or seconds {seconds}")
        if nbytes and self._fit(nbytes, seconds):
            return
        seconds -= self.copy_latency
        if nbytes == 0 or seconds <= 0:
            return  # nothing measurable (a control task, a clock too coarse, or all latency)
        a = self.alpha if self.copy_samples else 1.0  # the first measurement replaces the prior
        self.copy_bandwidth += a * (nbytes / seconds - self.copy_bandwidth)
        self.copy_samples += 1

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        if tokens < 0 or seconds < 0:
            raise ValueError(f"observe_prefill: negative tokens {tokens} or seconds {seconds}")
        if tokens == 0 or seconds == 0:
            return
        a = self.alpha if self.prefill_samples else 1.0
        self.prefill_rate += a * (tokens / seconds - self.prefill_rate)
        self.prefill_samples += 1

    def _fit(self, x: float, y: float) -> bool:
        """Feeds the moments; True if the tasks' sizes vary enough that the line through them
        gave both bandwidth and latency."""
        a = self.alpha if self._task_samples else 1.0
        self._moments = mx, my, mxx, mxy = tuple(m + a * (v - m) for m, v in zip(
            self._moments, (x, y, x * x, x * y), strict=True))
        self._task_samples += 1
        var, cov = mxx - mx * mx, mxy - mx * my
        if var <= (0.25 * mx) ** 2 or cov <= 0:
            return False  # all about one size (or noise sloping down): latency stays the prior
        self.copy_bandwidth = var / cov
        self.copy_latency = max(0.0, my - mx / self.copy_bandwidth)
        self.copy_samples += 1
        return True

    def observe_step(self, prefill: int, decode: int, seconds: float) -> None:
        """A step computed ``prefill`` tokens in chunks and ``decode`` single tokens."""
        if seconds <= 0:
            return
        if not prefill:
            if decode:
                a = self.alpha if self.floor_samples else 1.0
                self.step_floor += a * (seconds - self.step_floor)
                self.floor_samples += 1
        elif self.floor_samples:
            self.observe_prefill(prefill, max(0.0, seconds - self.step_floor))  # all under the floor: nothing
        elif prefill >= decode:  # no floor known yet: the whole step, the best there is
            self.observe_prefill(prefill + decode, seconds)

    def offload_seconds(self, num_blocks: int) -> float:
        if not num_blocks:
            return 0.0  # nothing to copy: OFFLOADED at once
        return 2.0 * (self.copy_latency + num_blocks * self.block_bytes / self.copy_bandwidth)

    def recompute_seconds(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_rate

    def prefer_offload(self, num_tokens: int, num_blocks: int) -> bool:
        """Whether copying ``num_blocks`` out and back beats recomputing ``num_tokens``
        (a victim's ``PreemptionWork``)."""
        return self.offload_seconds(num_blocks) < self.recompute_seconds(num_tokens)

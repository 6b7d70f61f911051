"""Online estimates that decide ``auto`` preemption: copy bandwidth and prefill rate.

Offloading a victim costs two copies of the blocks it has no host copy of (out now, in at
resume); recomputing it costs a prefill of the tokens after its host-copied prefix (what
``CacheManager.preemption_work`` counts: both modes swap the host-copied blocks back in).
But only an offload holds those host copies until the restore. After a recompute they are
cached like any other block, and the copies of the requests that run meanwhile evict them
when the host tier is full: then the whole prefix is computed again. So a recompute is also
charged the host-copied tokens, weighted by the host tier's occupancy (``host_occupancy``:
the share of it not free). A long victim beside a full host tier is offloaded (pinning its
copies costs little: only the blocks without one are copied); a short one is still recomputed,
its prefill riding free on a decode step; with room on the host, copies are trusted to last.
Both rates are exponentially weighted moving averages of what the engine measured
(``observe_copy`` from transfer completions, ``observe_step`` from steps), starting from
configured priors.

A step costs a floor whatever its prefill (a decode step reads all the weights: on a GPU the
prefill tokens of a mixed step ride on it), so the prefill rate is the marginal one: a
prefill step's tokens over its time beyond the floor, which decode-only steps measure.
Tokens per whole step would put the rate an order of magnitude low under a roofline model
and make every recompute look expensive. Under a roofline a step costs
max(floor, tokens / rate): the first ``free_tokens`` of prefill ride on the floor at no cost
and the rest cost 1 / rate each, so a step's time beyond the floor is a line in its prefill
tokens, (tokens - free_tokens) / rate, fitted like the copies' below. Steps within the floor's
noise say only that their prefill rode free and are left out: a rate taken from them (a few
tokens over a few microseconds of jitter) is absurdly high, and would price recomputing any
victim at next to nothing.

A copy also costs a fixed ``copy_latency`` per task (the transfer path's round trip, which
bench_swap measures as ``empty_task_rtt_us``): that is what makes the choice depend on the
victim's context. A short context recomputes in less time than two round trips; a long one
copies faster than it recomputes. The bandwidth estimate leaves the latency out. Once tasks of
different sizes were seen, both come from a least-squares line through them (seconds = latency
+ bytes / bandwidth, over exponentially weighted moments): tasks of a few blocks take mostly
latency, and charging it all to bandwidth put the bandwidth ~50x low and every offload too dear.
"""
from __future__ import annotations

from dataclasses import dataclass, field

FLOOR_NOISE = 0.05  # a step within 5 % of the decode floor carried its prefill free


@dataclass(slots=True)
class _Line:
    """Least squares of y = intercept + slope * x over exponentially weighted moments."""

    moments: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)  # mean x, y, x^2, x*y
    samples: int = 0

    def add(self, x: float, y: float, alpha: float) -> tuple[float, float] | None:
        """Feeds (x, y); the line (intercept, slope) once the x vary enough and y rises with
        them, else None."""
        a = alpha if self.samples else 1.0
        self.moments = mx, my, mxx, mxy = tuple(m + a * (v - m) for m, v in zip(
            self.moments, (x, y, x * x, x * y), strict=True))
        self.samples += 1
        var, cov = mxx - mx * mx, mxy - mx * my
        if var <= (0.25 * mx) ** 2 or cov <= 0:
            return None
        slope = cov / var
        return my - slope * mx, slope


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
    free_tokens: float = 0.0  # prefill tokens a step carries within its floor (the roofline's knee)
    _copies: _Line = field(default_factory=_Line)  # copy tasks: (bytes, seconds)
    _prefills: _Line = field(default_factory=_Line)  # prefill steps: (tokens, seconds beyond the floor)

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
        """True if the tasks' sizes vary enough that the line through them gave both bandwidth
        and latency (else the latency stays the prior)."""
        line = self._copies.add(x, y, self.alpha)
        if line is None:
            return False
        latency, seconds_per_byte = line
        self.copy_bandwidth = 1.0 / seconds_per_byte
        self.copy_latency = max(0.0, latency)
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
            beyond = seconds - self.step_floor
            if beyond <= FLOOR_NOISE * self.step_floor:
                return  # it rode on the floor: no rate in it (module docstring)
            line = self._prefills.add(prefill, beyond, self.alpha)
            if line is None:  # all about one size: the marginal rate, nothing known to ride free
                self.observe_prefill(prefill, beyond)
                return
            intercept, seconds_per_token = line
            self.prefill_rate = 1.0 / seconds_per_token
            self.free_tokens = max(0.0, -intercept * self.prefill_rate)
            self.prefill_samples += 1
        elif prefill >= decode:  # no floor known yet: the whole step, the best there is
            self.observe_prefill(prefill + decode, seconds)

    def offload_seconds(self, num_blocks: int) -> float:
        if not num_blocks:
            return 0.0  # nothing to copy: OFFLOADED at once
        return 2.0 * (self.copy_latency + num_blocks * self.block_bytes / self.copy_bandwidth)

    def recompute_seconds(self, num_tokens: int) -> float:
        """A recompute's prefill rides on a step beside the decodes: its first ``free_tokens``
        cost nothing."""
        return max(0.0, num_tokens - self.free_tokens) / self.prefill_rate

    def prefer_offload(self, num_tokens: int, num_blocks: int, unheld_tokens: int, risk: float) -> bool:
        """Whether copying ``num_blocks`` out and back beats recomputing ``num_tokens`` (a
        victim's ``PreemptionWork``), and ``unheld_tokens`` more with probability ``risk``: the
        tokens whose host copies a recompute counts on without holding them (an offload holds
        them), which another request's copies may evict before the victim returns."""
        if not 0.0 <= risk <= 1.0:
            raise ValueError(f"prefer_offload: risk {risk} must be in [0, 1]")
        return self.offload_seconds(num_blocks) < self.recompute_seconds(num_tokens + risk * unheld_tokens)

"""The engine's metrics: one prometheus_client registry per engine (never the global one,
so two engines in one process, or a test, do not collide), served on request.

Two kinds of series:

* observed on the hot path: step latency and copy-task latency histograms, copy bytes and
  seconds per kind, finished requests and tokens (each ``observe_*`` is a few microseconds);
* read at scrape time from the scheduler and the cache manager (a custom collector, so
  nothing is copied per step): hit ratio per tier, blocks per state per tier, preemptions
  by mode, recomputed tokens, request counts by state.

``summary()`` computes the numbers of the engine's summary.json from the same objects, so
the report and the endpoint cannot disagree.
"""
from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from fastkv.sched import Scheduler

TIERS = ("device", "host", "storage")
MODES = ("recompute", "offload", "storage")
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SAMPLES = 1 << 20  # raw latencies kept for exact percentiles (the most recent ones)


def _percentile_ms(samples: deque, q: float) -> float:
    return float(np.percentile(np.fromiter(samples, float, len(samples)), q) * 1e3) if samples else 0.0


class EngineMetrics:
    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.registry = CollectorRegistry()
        r = self.registry
        self.step_seconds = Histogram("fastkv_step_seconds", "Wall time of one model step (plan sent to output)",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.task_seconds = Histogram("fastkv_copy_task_seconds", "Copy task time (slowest rank)", ["kind"],
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.copy_bytes = Counter("fastkv_copy_bytes", "Bytes copied by finished tasks (all ranks)", ["kind"],
                                  registry=r)
        self.copy_failures = Counter("fastkv_copy_failures", "Copy tasks that failed", ["kind"], registry=r)
        self.finished = Counter("fastkv_requests_finished", "Finished requests", ["finish"], registry=r)
        self.generated = Counter("fastkv_generated_tokens", "Tokens sampled", registry=r)
        self.prompt_tokens = Counter("fastkv_prompt_tokens", "Prompt tokens of submitted requests", registry=r)
        r.register(_SchedulerCollector(self))
        self.step_s: deque[float] = deque(maxlen=_SAMPLES)
        self.task_s: deque[float] = deque(maxlen=_SAMPLES)
        self.tokens_sampled = 0
        self.copied_bytes = 0
        self.copy_tasks: dict[str, int] = {}  # finished ok, by kind
        self.copy_busy_s = 0.0
        self._server: Any = None
        self.events: Any = None  # fastkv.events.KVEvents while KV events are on

    # -- hot path ----------------------------------------------------------------------
    def observe_step(self, seconds: float, sampled: int) -> None:
        self.step_seconds.observe(seconds)
        self.step_s.append(seconds)
        self.generated.inc(sampled)
        self.tokens_sampled += sampled

    def observe_copy(self, kind: str, ok: bool, nbytes: int, seconds: float) -> None:
        self.task_seconds.labels(kind).observe(seconds)
        self.task_s.append(seconds)
        if ok:
            self.copy_bytes.labels(kind).inc(nbytes)
            self.copy_tasks[kind] = self.copy_tasks.get(kind, 0) + 1
            self.copied_bytes += nbytes
            self.copy_busy_s += seconds
        else:
            self.copy_failures.labels(kind).inc()

    def observe_finished(self, finish: str) -> None:
        self.finished.labels(finish).inc()

    # -- derived numbers ---------------------------------------------------------------
    def copy_gbps(self) -> float:
        """Bytes moved per second of copy-task time (all ranks' bytes over the slowest rank's time)."""
        return self.copied_bytes / self.copy_busy_s / 1e9 if self.copy_busy_s else 0.0

    def hit_ratios(self) -> dict[str, float]:
        stats = self.scheduler.cache.stats
        return {t: stats.hit_ratio(t) for t in TIERS}

    def blocks(self) -> dict[str, dict[str, int]]:
        out = {}
        for pool in (self.scheduler.cache.device, self.scheduler.cache.host):
            out[pool.tier] = {"free": pool.num_free, "allocated": pool.num_allocated, "cached": pool.num_cached,
                              "in_flight": pool.num_in_flight}
        return out

    def preemptions(self) -> dict[str, int]:
        st = self.scheduler.stats
        return {"recompute": st.preempt_recompute, "offload": st.preempt_offload, "storage": st.preempt_storage}

    def summary(self) -> dict[str, Any]:
        """The metric part of summary.json (see SEAMS.md)."""
        return {
            "recomputed_tokens": self.scheduler.stats.recomputed_tokens,
            "preemptions": self.preemptions(),
            "hit_ratio": self.hit_ratios(),
            "copy_gbps": self.copy_gbps(),
            "step_ms_p50": _percentile_ms(self.step_s, 50),
            "step_ms_p99": _percentile_ms(self.step_s, 99),
            "task_ms_p50": _percentile_ms(self.task_s, 50),
            "copy_tasks": dict(self.copy_tasks),  # beyond SEAMS.md: successful copy tasks by kind
        }

    # -- endpoint ----------------------------------------------------------------------
    def serve(self, port: int, addr: str = "127.0.0.1") -> int:
        """Expose ``/metrics`` on ``addr:port`` from a daemon thread; port 0 = off. Returns the port."""
        if not isinstance(port, int) or not 0 <= port < 65536:
            raise ValueError(f"metrics port must be an int in [0, 65536), got {port!r}")
        if port == 0:
            return 0
        if self._server is not None:
            raise ValueError("metrics are already being served")
        self._server, _thread = start_http_server(port, addr, registry=self.registry)
        return self._server.server_port

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _SchedulerCollector:
    """Reads the scheduler's and cache manager's counters at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []  # no fixed description: the registry must not call collect() at registration

    def collect(self):
        m, s = self.m, self.m.scheduler
        hit = GaugeMetricFamily("fastkv_hit_ratio", "Prompt tokens found cached, by tier", labels=["tier"])
        for tier, ratio in m.hit_ratios().items():
            hit.add_metric([tier], ratio)
        yield hit
        blocks = GaugeMetricFamily("fastkv_blocks", "Blocks by tier and state", labels=["tier", "state"])
        for tier, states in m.blocks().items():
            for state, n in states.items():
                blocks.add_metric([tier, state], n)
        yield blocks
        pre = CounterMetricFamily("fastkv_preemptions", "Preemptions by mode", labels=["mode"])
        for mode, n in m.preemptions().items():
            pre.add_metric([mode], n)
        yield pre
        yield CounterMetricFamily("fastkv_recomputed_tokens", "Tokens computed again after a preemption",
                                  value=s.stats.recomputed_tokens)
        bw = GaugeMetricFamily("fastkv_copy_bandwidth_bytes_per_second", "Copy bandwidth over all finished tasks")
        bw.add_metric([], m.copy_gbps() * 1e9)
        yield bw
        if m.events is not None:
            ev = m.events.stats()
            batches = CounterMetricFamily("fastkv_kv_event_batches", "KV event batches: published, and dropped "
                                          "from the live stream (the publisher thread was behind)", labels=["outcome"])
            batches.add_metric(["published"], ev["batches"])
            batches.add_metric(["dropped"], ev["dropped"])
            yield batches
        reqs = GaugeMetricFamily("fastkv_requests", "Unfinished requests by state", labels=["state"])
        for state, n in s.counts().items():
            reqs.add_metric([state], n)
        yield reqs

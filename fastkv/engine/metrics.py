"""The engine's metrics: one prometheus_client registry per engine (never the global one,
so two engines in one process, or a test, do not collide), served on request.

Counters (``rate()`` them, ``sum`` them across engines): finished requests, generated and
prompt tokens, prompt tokens looked up and hit per tier, copy tasks and their bytes by kind,
copy failures, preemptions by mode, recomputed tokens, storage errors and corrupt values,
host checksum mismatches per rank. Gauges only for levels: blocks per tier and state,
unfinished requests per state, copy tasks in flight. Histograms: step and copy-task time.
Every series carries the constant labels ``role`` and ``run_id`` (``labels``), so engines of
a prefill/decode pair or of two runs aggregate in one query.

Counters on the hot path are observed (``observe_*``, a few microseconds); the rest are
read at scrape time from the scheduler, the cache manager and the run's signals (a custom
collector: nothing is copied per step). ``freeze()`` keeps the last values for the scrapes
that come after the engine let go of them (``linger``), and ``write_textfile`` leaves them
in a file.

``summary()`` computes the numbers of the engine's summary.json from the same objects, so
the report and the endpoint cannot disagree.
"""
from __future__ import annotations

import socket
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Histogram, start_http_server, write_to_textfile
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:
    from fastkv.sched import Scheduler

TIERS = ("device", "host", "storage")
MODES = ("recompute", "offload", "storage")
_LATENCY_BUCKETS = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
_SAMPLES = 1 << 20  # raw latencies kept for exact percentiles (the most recent ones)


def _percentile_ms(samples: deque, q: float) -> float:
    return float(np.percentile(np.fromiter(samples, float, len(samples)), q) * 1e3) if samples else 0.0


def check_port(port: int, addr: str = "127.0.0.1") -> None:
    """ValueError naming ``--metrics-port`` when the engine could not serve on it: checked
    before anything of the run starts (the engine binds it with SO_REUSEADDR, as here)."""
    if not port:
        return
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((addr, port))
        except OSError as exc:
            raise ValueError(f"--metrics-port {port}: cannot serve on {addr}:{port} ({exc.strerror}); "
                             "give a free port, or 0 for no endpoint") from None


class EngineMetrics:
    """``labels``: constant labels of every series (role, run_id). ``signals``: the run's
    signal array (storage faults and checksum mismatches per rank), or None. ``tp``: ranks."""

    def __init__(self, scheduler: Scheduler, labels: dict[str, str] | None = None, signals: Any = None,
                 tp: int = 1) -> None:
        self.scheduler = scheduler
        self.signals, self.tp = signals, tp
        r = self._own = CollectorRegistry()
        self._labelled = _ConstLabels(r, dict(labels or {}))
        self.registry = CollectorRegistry()  # what is served: the series above, with the constant labels
        self.registry.register(self._labelled)
        self.step_seconds = Histogram("fastkv_step_seconds", "Wall time of one model step (plan sent to output)",
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.task_seconds = Histogram("fastkv_copy_task_seconds", "Copy task time (slowest rank)", ["kind"],
                                      registry=r, buckets=_LATENCY_BUCKETS)
        self.copy_bytes = Counter("fastkv_copy_bytes", "Bytes copied by finished tasks (all ranks)", ["kind"],
                                  registry=r)
        self.copies = Counter("fastkv_copies", "Copy tasks that finished ok", ["kind"], registry=r)
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
        self.beat_s = 0.5  # how often linger() beats
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
            self.copies.labels(kind).inc()
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
        cache = self.scheduler.cache
        groups = getattr(cache, "groups", None)  # a hybrid layout: a device and a host pool per KV cache group
        if groups is None:
            pools = [cache.device, cache.host]
        else:
            hosts = [gp.host for gp in groups.groups] if cache.has_host_tier else [cache.host]
            pools = [gp.pool for gp in groups.groups] + hosts
        for pool in pools:
            out[pool.tier] = {"free": pool.num_free, "allocated": pool.num_allocated, "cached": pool.num_cached,
                              "in_flight": pool.num_in_flight}
        return out

    def preemptions(self) -> dict[str, int]:
        st = self.scheduler.stats
        return {"recompute": st.preempt_recompute, "offload": st.preempt_offload, "storage": st.preempt_storage}

    def summary(self) -> dict[str, Any]:
        """The metric part of summary.json (docs/FORMATS.md)."""
        return {
            "recomputed_tokens": self.scheduler.stats.recomputed_tokens,
            "preemptions": self.preemptions(),
            "hit_ratio": self.hit_ratios(),
            "copy_gbps": self.copy_gbps(),
            "step_ms_p50": _percentile_ms(self.step_s, 50),
            "step_ms_p99": _percentile_ms(self.step_s, 99),
            "task_ms_p50": _percentile_ms(self.task_s, 50),
            "copy_tasks": dict(self.copy_tasks),  # successful copy tasks by kind
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

    def freeze(self) -> None:
        """From now on every scrape shows the values of this moment (the engine is letting go
        of the scheduler and the signals)."""
        self._labelled.frozen = list(self._labelled.collect())

    def write_textfile(self, path: str | Path) -> Path:
        """The exposition of now, as a node_exporter textfile (written atomically)."""
        write_to_textfile(str(path), self.registry)
        return Path(path)

    def linger(self, seconds: float, beat: Callable[[], None], stopped: Callable[[], bool]) -> None:
        """Keeps the endpoint up ``seconds`` more (the final scrape window), calling ``beat``
        every ``beat_s`` and ending early once ``stopped()``. A no-op when not serving."""
        if self._server is None:
            return
        deadline = time.monotonic() + seconds
        idle = threading.Event()  # never set: a blocking wait, not a sleep loop
        while (left := deadline - time.monotonic()) > 0 and not stopped():
            beat()
            idle.wait(min(left, self.beat_s))

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


class _ConstLabels:
    """The series of ``registry``, each with ``labels`` added; once ``frozen``, those samples."""

    def __init__(self, registry: CollectorRegistry, labels: dict[str, str]) -> None:
        self.registry, self.labels = registry, labels
        self.frozen: list[Metric] | None = None

    def describe(self):
        return []

    def collect(self):
        if self.frozen is not None:
            yield from self.frozen
            return
        for fam in self.registry.collect():
            out = Metric(fam.name, fam.documentation, fam.type, fam.unit)
            for smp in fam.samples:
                if smp.name.endswith("_created"):  # creation times: exported as gauges, not levels
                    continue
                out.add_sample(smp.name, {**self.labels, **smp.labels}, smp.value, smp.timestamp, smp.exemplar)
            yield out


class _SchedulerCollector:
    """Reads the scheduler's and cache manager's counters at scrape time."""

    def __init__(self, metrics: EngineMetrics) -> None:
        self.m = metrics

    def describe(self):
        return []  # no fixed description: the registry must not call collect() at registration

    def collect(self):
        m, s = self.m, self.m.scheduler
        stats = s.cache.stats
        hits = CounterMetricFamily("fastkv_hit_tokens", "Prompt tokens served from a cache tier, by tier",
                                   labels=["tier"])
        for tier in TIERS:
            hits.add_metric([tier], getattr(stats, f"{tier}_hit_tokens"))
        yield hits
        chosen = CounterMetricFamily("fastkv_hit_choice_tokens", "Prompt tokens of host and storage hits, by "
                                     "what the hit policy chose: load, or recompute", labels=["tier", "choice"])
        for choice, by_tier in (("load", s.hits.stats.loaded_tokens), ("recompute", s.hits.stats.recomputed_tokens)):
            for tier, n in by_tier.items():
                chosen.add_metric([tier, choice], n)
        yield chosen
        yield CounterMetricFamily("fastkv_lookup_tokens", "Prompt tokens looked up in the prefix cache "
                                  "(hit_tokens / lookup_tokens = the hit ratio)", value=stats.prompt_tokens)
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
        yield CounterMetricFamily("fastkv_storage_skipped_blocks", "Blocks a storage write policy wanted stored, "
                                  "lost to the pool: deferred while the storage tier was behind and evicted from "
                                  "the host before it caught up", value=stats.skipped_stores)
        by_reason = CounterMetricFamily("fastkv_storage_skipped_blocks_by_reason", "Blocks a storage write policy "
                                        "wanted stored and did not: already_stored (the pool held them), or lost "
                                        "while storage was behind: tail (unshared), shared", labels=["reason"])
        for reason, n in stats.skipped_by().items():
            by_reason.add_metric([reason], n)
        yield by_reason
        yield CounterMetricFamily("fastkv_storage_late_blocks", "Blocks whose STORE was deferred while the storage "
                                  "tier was behind, stored once it caught up", value=stats.late_stores)
        if m.events is not None:
            ev = m.events.stats()
            batches = CounterMetricFamily("fastkv_kv_event_batches", "KV event batches: published, and those "
                                          "dropped: a subscriber's queue was full, none got it live (kept for "
                                          "replay)", labels=["outcome"])
            batches.add_metric(["published"], ev["batches"])
            batches.add_metric(["dropped"], ev["dropped"])
            yield batches
        reqs = GaugeMetricFamily("fastkv_requests", "Unfinished requests by state", labels=["state"])
        counts = s.counts()
        in_flight = counts.pop("copies_in_flight", 0)  # copy tasks, not requests
        for state, n in counts.items():
            reqs.add_metric([state], n)
        yield reqs
        yield GaugeMetricFamily("fastkv_copies_in_flight", "Copy tasks sent and not yet done", value=in_flight)
        if m.signals is not None:
            sig = m.signals
            yield CounterMetricFamily("fastkv_storage_errors", "Storage operations that failed (all ranks)",
                                      value=sig["storage.errors"])
            yield CounterMetricFamily("fastkv_storage_corrupt_values", "Stored values that failed verification "
                                      "(all ranks)", value=sig["storage.corrupt"])
            bad = CounterMetricFamily("fastkv_host_checksum_mismatches", "Host blocks whose checksum failed "
                                      "(each recomputed, never served)", labels=["rank"])
            for r in range(m.tp):
                bad.add_metric([str(r)], sig[f"transfer{r}.host_checksum_mismatches"])
            yield bad

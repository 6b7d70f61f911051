"""The engine: scheduler + cache manager + transfer client + the worker channels.

One thread drives it. ``step()`` plans a step (``Scheduler.step``), hands its copy plans to
the transfer client (which never waits for a copy), sends the step's ``PlanMsg`` to every
worker rank and blocks on the inbox doorbell until rank 0's ``OutputMsg`` arrives, feeding
every copy completion that arrives meanwhile to the scheduler. With async scheduling
(``RunSpec.async_scheduling``, on by default) it plans and sends the next step before it
waits, so the workers start step N+1 as soon as step N is done: each ``step()`` then
applies one step's output while the next one runs (``Scheduler.step(overlap=True)`` says
what such a plan may do; tokens of a request that stopped one step earlier are discarded,
so outputs are exactly the synchronous ones). Weight updates and a preemption that needs a
request of the step in flight plan synchronously; the decode role always does (it reserves
blocks between steps). When nothing can run but
copies are in flight it blocks on the inbox instead (timeout ``heartbeat_s``, then
``TransferClient.check()`` fails tasks of dead ranks and tasks past ``task_timeout_s``).
A transfer rank that dies fails its tasks (their requests recompute) and is used again
once the supervisor restarted it (``TransferClient`` adopts the new process); a worker
that dies or reports an error raises ``EngineError``: the model state is gone and the
run must not pretend otherwise.

Embedding (a Paddle deployment with its own workers): ``fastkv.launch`` sets the run up,
``Engine.attach(spec)`` runs in the serving process (``step_stream`` for the tokens of each
step; ``add_request`` and ``abort`` from any thread, the steps from one), and the workers
follow ``fastkv.engine.worker_api`` (docs/WORKER_API.md; ``tests/e2e/embed_example.py``).
"""
from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, NamedTuple

from fastkv.cache import request_policy
from fastkv.cache.group_manager import GroupedManager
from fastkv.cache.keys import ExtraKeys
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import ClearTask, CopyKind, CopyPlan
from fastkv.cache.write_policy import StorageWrites, Tier
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.deploy.cost_model import scaled_for
from fastkv.engine import health, protocol
from fastkv.engine.handoff import Exporter, HandoffStats
from fastkv.engine.lookup import StorageLookup
from fastkv.engine.metrics import EngineMetrics
from fastkv.engine.sampling import Sampling, request_params
from fastkv.engine.timeline import GpuClock
from fastkv.ipc import (
    Broadcast,
    ChannelClosed,
    DoneMsg,
    Namespace,
    OutputMsg,
    PeerDied,
    PeerTimeout,
    PlanMsg,
    pid_alive,
)
from fastkv.ipc.peers import exit_status, wait_exit
from fastkv.procs.children import describe_exit, last_line
from fastkv.run import EngineEnds, RunSpec, attach_engine
from fastkv.sched import PreemptionMode, Request, RequestState, Scheduler, SchedulerConfig, WeightUpdate
from fastkv.sched.hits import HitCosts, HitPolicy
from fastkv.sched.output import StepPlan
from fastkv.sched.queues import QueuePolicy
from fastkv.sched.reservation import Refusal, Reservation

FINISH = {RequestState.FINISHED_LENGTH: "length", RequestState.FINISHED_STOPPED: "stop",
          RequestState.FINISHED_ABORTED: "aborted"}
_STALL_STEPS = 1000  # consecutive empty steps with no copy in flight: the scheduler is stuck


class EngineError(RuntimeError):
    """A worker died or failed a step: the run cannot go on."""


class RequestRejected(ValueError):
    """A request this engine can never serve as asked (``reason``, in the caller's terms)."""

    def __init__(self, request_id: str, reason: str) -> None:
        super().__init__(f"request {request_id!r} rejected: {reason}")
        self.request_id, self.reason = request_id, reason


class EngineStopped(EngineError):
    """The supervisor set ``stop`` while the engine waited on a worker or a transfer rank."""


class RequestResult(NamedTuple):
    id: str
    output: list[int]  # what was sampled, also for a request that did not finish
    finish: str  # "length" | "stop" | "aborted" | "rejected" | "unfinished"
    ttft_s: float  # arrival to first sampled token (NaN if none)
    latency_s: float  # arrival to finish (to now for an unfinished request; NaN if never admitted)
    preemptions: int
    recomputed_tokens: int
    state: str = "finished"  # "finished" | "aborted" | "rejected" | "unfinished"
    reason: str = ""  # why it was rejected
    # the weights that sampled its output: one version, or "v1+v2" when an update came in the middle
    weights_version: str = ""

    def to_json(self) -> dict[str, Any]:
        return self._asdict()


class StepUpdate(NamedTuple):
    """What one ``step_stream()`` produced: per request (the caller's id) the tokens sampled
    in this step, in order, and the requests that finished (with ``finish``, the reason)."""

    tokens: dict[str, list[int]]
    finished: list[RequestResult]


def _enum(cls: type, value: Any) -> Any:
    return cls[value.upper()] if isinstance(value, str) else cls(value)


def cache_config(spec: RunSpec) -> CacheConfig:
    return CacheConfig(num_device_blocks=spec.num_device_blocks, num_host_blocks=spec.num_host_blocks,
                       block_size=spec.layout.block_size, policy=_enum(CachePolicy, spec.cache_policy),
                       eviction=spec.eviction, storage=bool(spec.storage_url),
                       storage_writes=_enum(StorageWrites, spec.storage_writes), model_id=spec.model_id,
                       storage_backlog_blocks=spec.storage_backlog_blocks,
                       weights_version=spec.weights_version, layout=spec.layout)


def hit_policy(spec: RunSpec) -> HitPolicy:
    """The run's hit policy, judged by the synthetic runner's cost model if it has one."""
    bs = spec.layout.block_size
    model = scaled_for(spec.runner, spec.runner_options, spec.layout)
    return HitPolicy(bs, spec.hit_policy, None if model is None else HitCosts.of(model, bs, spec.layout.block_bytes))


def scheduler_config(spec: RunSpec) -> SchedulerConfig:
    """``spec.scheduler`` as a SchedulerConfig; enum fields may be given by name ("offload")."""
    opts = dict(spec.scheduler)
    if spec.role == "decode":  # records that failed, and failed loads, are admitted here
        opts.setdefault("growth_admission", True)
    if "preemption" in opts:
        opts["preemption"] = _enum(PreemptionMode, opts["preemption"])
    if "policy" in opts:
        opts["policy"] = _enum(QueuePolicy, opts["policy"])
    return SchedulerConfig(**opts)


class Engine:
    """See the module docstring. ``client_factory(ends, spec)`` builds the transfer client
    (default ``fastkv.transfer.client.TransferClient``); ``check`` runs check_integrity of
    the scheduler and the cache after every step (tests)."""

    def __init__(self, spec: RunSpec, ends: EngineEnds, client_factory: Callable[[EngineEnds, RunSpec], Any] | None
                 = None, *, check: bool = False) -> None:
        self.spec = spec
        self.ends = ends
        sched_config = scheduler_config(spec)
        if spec.layout.is_hybrid:  # one device pool and table per KV cache group (fastkv.cache.group_manager)
            self.cache = GroupedManager(cache_config(spec), spec.device_group_blocks(),
                                        sched_config.max_num_batched_tokens, spec.host_group_blocks())
        else:
            self.cache = CacheManager(cache_config(spec))
        self.sched = Scheduler(self.cache, sched_config, hits=hit_policy(spec))
        if self.sched.config.preemption is PreemptionMode.STORAGE and not spec.storage_url:
            raise ValueError("RunSpec.scheduler: preemption 'storage' needs a storage tier (RunSpec.storage_url)")
        if client_factory is None:
            from fastkv.transfer.client import TransferClient as client_factory
        self.transfer = client_factory(ends, spec)
        self.metrics = EngineMetrics(self.sched, {"role": spec.role, "run_id": spec.run_id}, ends.signals,
                                     spec.tp_size)
        self.metrics.beat_s = spec.heartbeat_s
        self.events = None  # KV events for routers (fastkv.events), published once per step
        events = spec.events_config()
        if events is not None:
            from fastkv.events import KVEvents

            self.events = self.metrics.events = KVEvents(self.cache, events)
        # with a storage tier, new requests first ask it what it holds (fastkv.engine.lookup)
        self.lookups = None
        if spec.storage_url:  # a LOOKUP's keys take at most a quarter of the task ring
            self.lookups = StorageLookup(self.cache, spec.storage_lookup_timeout_s,
                                         spec.slot_size * spec.nslots // (4 * 40), policy=spec.prefetch_policy,
                                         per_1k_tokens_s=spec.prefetch_timeout_per_1k_tokens_s)
        self.checking = check  # check() after every step (tests)
        self.gpu_clock = GpuClock()  # where the wall goes, from the GPU's side (summary gpu_busy)
        self._broadcast = Broadcast(ends.plans)
        self._sig = ends.signals
        self._ext: dict[int, str] = {}  # scheduler id -> caller's id
        self._ids: dict[str, int] = {}
        self._next_id = 0
        self._release: list[int] = []  # finished since the last plan: the runners may forget them
        self._params: dict[int, str] = {}  # requests not yet in a plan -> their PlanMsg.params entry
        self._tokens: dict[str, list[int]] = {}  # sampled in the step being run, by the caller's id
        # async scheduling: plans sent whose output is not in yet (oldest first), with their send time
        self.async_scheduling = spec.async_scheduling and spec.role != "decode"
        self._flight: list[tuple[StepPlan, float]] = []
        self._last_output = 0.0  # when the last step's output came in: the next step's wall time starts there
        self._held: dict[str, list[int]] = {}  # tokens of requests that stopped, kept for their result's update
        self.overlapped_steps = 0  # steps sent while the one before was still running
        self.plans_on_landing = 0  # plans sent whose layers wait for a layered SWAP_IN (summary)
        self.sync_plans = 0  # plans made after the step in flight because a preemption waited on it
        # steps' wall time, each from its send, or from the output before it when that came later
        # (the time the workers reported for them is gpu_clock.gpu_s)
        self.step_wall_s = 0.0
        self._outputs: list[OutputMsg] = []  # outputs received, oldest first, not yet taken by _output
        # add_request/abort from other threads: queued under this, taken by the driving thread
        self._cond = threading.Condition(threading.RLock())
        self._incoming: list[tuple[Request, str]] = []
        self._late: list[RequestResult] = []  # rejected when taken by abort(): the next step reports them
        self._aborts: list[str] = []
        self._owner = threading.get_ident()  # the thread driving step(): the last to call it
        self._stepping = False
        self._idle = 0
        self._last_check = 0.0  # last look at the workers' pids
        self._ns: Namespace | None = None
        self.weights_version = spec.weights_version
        self.weight_updates = 0
        self._free_memory = False  # of the weight update in progress
        self._sampled_by: dict[int, list[str]] = {}  # scheduler id -> weights versions that sampled its tokens
        self._from_store: dict[int, float] = {}  # handoffs through the store being loaded -> reserve time
        self._arrived: list[int] = []  # their loads are in: prefilled before the next step
        self.handoff_stats: HandoffStats | None = None  # set by the decode role (fastkv.engine.handoff)
        self.exporter: Exporter | None = None
        if spec.role == "prefill":
            self.exporter = Exporter(self.cache, spec.out_dir, spec.layout.block_bytes * spec.tp_size,
                                     self._ext.__getitem__, self.sched.outbox.emit)
            self.sched.before_free = self.exporter.before_free
        self._sig["engine.pid"] = os.getpid()
        self.beat()

    @classmethod
    def attach(cls, spec: RunSpec, client_factory: Callable | None = None, **kw: Any) -> Engine:
        """Attach to a run the supervisor created (``create_run``) and start an engine on it."""
        ns = Namespace.attach(spec.run_id)
        engine = cls(spec, attach_engine(ns, spec), client_factory, **kw)
        engine._ns = ns
        return engine

    # ================================================================== requests
    def add_request(self, prompt: Iterable[int], max_new_tokens: int, *, request_id: str | None = None,
                    preemption: str | PreemptionMode | None = None, eos_token_id: int | None = None,
                    stop_token_ids: Iterable[int] = (), arrival_time: float | None = None,
                    sampling: Sampling | dict[str, Any] | None = None, cache_salt: str | bytes | None = None,
                    lora: str | int | None = None, mm_items: Iterable = (), cache: bool | dict | None = None) -> str:
        """Queue a request; returns its id (``request_id``, or a fresh one). ``preemption``
        overrides the deployment's mode for this request ("recompute", "offload", "storage",
        "auto"); ``arrival_time`` (time.monotonic) defaults to now. ``sampling`` (a
        ``Sampling`` or a dict of its fields) goes to the workers untouched, in the request's
        first plan; its ``stop_token_ids`` also stop the request here. ``cache_salt`` (a
        tenant's secret: requests share KV, in every tier, only under the same salt), ``lora``
        (the adapter's id: it changes every K and V) and ``mm_items`` (multimodal items,
        ``{"start", "end", "hash"}``: the blocks an item overlaps carry its hash) key the
        request's KV besides its tokens (``fastkv.cache.keys.ExtraKeys.of``). ``cache`` is its cache
        policy: ``False`` (don't cache it) or ``{"read": [tiers], "write": [] or every tier}``
        (``fastkv.cache.request_policy``). ValueError if the id is
        in use; RequestRejected (a ValueError) if the request is invalid or can never run to
        ``max_new_tokens``: prompt and output must fit in ``max_model_len`` (the device tier,
        or less), since a request is never cut short without saying so.

        Safe to call from any thread: called from one other than the thread driving ``step()``
        (or during a step), the request is checked here and enters at the next step; a thread
        blocked in ``wait_for_work`` wakes up."""
        with self._cond:
            req, ext, params = self._new_request(prompt, max_new_tokens, request_id, preemption, eos_token_id,
                                                 stop_token_ids, arrival_time, sampling,
                                                 (cache_salt, lora, tuple(mm_items)), cache)
            if threading.get_ident() == self._owner and not self._stepping:
                self._enter(req, ext)
            else:
                try:
                    self.sched.check_request(req)
                except (TypeError, ValueError) as exc:
                    raise RequestRejected(ext, str(exc).removeprefix(f"request {req.request_id}: ")) from None
                if req.arrival_time is None:
                    req.arrival_time = time.monotonic()
                self._incoming.append((req, ext))
                self._cond.notify_all()
            self._register(req, ext, params)
        return ext

    def _enter(self, req: Request, ext: str) -> None:
        try:
            # no LOOKUP for a request that could load nothing it found: the hit policy recomputes
            # every hit, or its cache policy may not read storage
            if (self.lookups is None or not self.sched.hits.loads_any
                    or not request_policy.reads(req.cache_policy, Tier.STORAGE)):
                self.sched.add_request(req)
            else:
                self.sched.check_request(req)
                self.lookups.park(req)
        except (TypeError, ValueError) as exc:
            raise RequestRejected(ext, str(exc).removeprefix(f"request {req.request_id}: ")) from None

    def _take_queued(self) -> list[RequestResult]:
        """The driving thread: the requests and aborts other threads queued."""
        with self._cond:
            incoming, self._incoming = self._incoming, []
            aborts, self._aborts = self._aborts, []
        results = []
        for req, ext in incoming:
            try:
                self._enter(req, ext)
            except RequestRejected as exc:  # checked when queued: the scheduler changed its mind since
                with self._cond:
                    del self._ext[req.request_id], self._ids[ext]
                    self._params.pop(req.request_id, None)
                results.append(self.rejected(ext, exc.reason, req.arrival_time))
        for ext in aborts:
            self._abort(ext)
        return results

    def _new_request(self, prompt: Iterable[int], max_new_tokens: int, request_id: str | None,
                     preemption: str | PreemptionMode | None, eos_token_id: int | None,
                     stop_token_ids: Iterable[int], arrival_time: float | None,
                     sampling: Sampling | dict[str, Any] | None = None,
                     keyed: tuple = (None, None, ()), cache: bool | dict | None = None) -> tuple[Request, str, str]:
        """``keyed``: (cache_salt, lora, mm_items), and ``cache``, as ``add_request`` takes them."""
        rid = self._next_id
        ext = str(rid) if request_id is None else str(request_id)
        if ext in self._ids:
            raise ValueError(f"request id {ext!r} is already in use")
        tokens = list(prompt)
        try:
            sampling = Sampling.of(sampling)
            stop_token_ids = [*stop_token_ids, *sampling.stop_token_ids]
            cap = self.sched.max_model_len
            need = len(tokens) + max_new_tokens if isinstance(max_new_tokens, int) else 0
            if need > cap:  # checked before Request sizes its token buffer for max_new_tokens
                bs = self.spec.layout.block_size
                raise ValueError(f"prompt {len(tokens)} + max_new_tokens {max_new_tokens} = {need} tokens exceed "
                                 f"max_model_len {cap} ({cap // bs} device blocks of {bs} tokens)")
            mode = None if preemption is None else _enum(PreemptionMode, preemption)
            if mode is PreemptionMode.STORAGE and not self.spec.storage_url:
                raise ValueError("preemption 'storage' needs a storage tier (RunSpec.storage_url)")
            extra = ExtraKeys.of(*keyed)
            if extra is not None and extra.mm and max(end for _, end, _ in extra.mm) > len(tokens):
                raise ValueError(f"mm_items: an item ends past the prompt's {len(tokens)} tokens")
            if not self.spec.enable_prefix_caching:  # keys salted per request: only its own KV hits
                extra = dataclasses.replace(extra or ExtraKeys(), tenant_salt=f"{self.spec.run_id}/{rid}")
            req = Request(rid, tokens, max_new_tokens, eos_token_id=eos_token_id,
                          stop_token_ids=frozenset(stop_token_ids), preemption=mode, arrival_time=arrival_time,
                          extra=extra, cache_policy=request_policy.CachePolicy.of(cache))
        except (TypeError, ValueError) as exc:
            # The scheduler names its own sequence number; the caller knows the request by ``ext``.
            raise RequestRejected(ext, str(exc).removeprefix(f"request {rid}: ")) from None
        return req, ext, request_params(ext, sampling)

    def _register(self, req: Request, ext: str, params: str) -> None:
        self._next_id += 1
        self._ext[req.request_id], self._ids[ext] = ext, req.request_id
        self._params[req.request_id] = params
        self.metrics.prompt_tokens.inc(req.num_prompt_tokens)

    # ================================================================== disaggregated serving
    def reserve_for_prefilled(self, prompt: Iterable[int], max_new_tokens: int, *, request_id: str,
                              from_store: bool = True, preemption: str | PreemptionMode | None = None,
                              eos_token_id: int | None = None, stop_token_ids: Iterable[int] = (),
                              arrival_time: float | None = None,
                              sampling: Sampling | dict[str, Any] | None = None,
                              cache_salt: str | bytes | None = None, lora: str | int | None = None,
                              mm_items: Iterable = (), cache: bool | dict | None = None) -> Reservation | Refusal:
        """Decode side: take a request another engine prefilled. Refused (a ``Refusal`` naming
        ``request_id`` and the reason, nothing changed) when the blocks it needs are not free
        beyond what the running requests keep for their growth; they are never preempted for it.
        ``from_store``: the prefill engine exported the prompt to the shared storage tier
        (``fastkv.engine.handoff``); it is LOADed here and the request decodes once it is in,
        recomputing only what the store no longer holds. Otherwise the caller writes the KV of
        ``[first_position, last_position)`` into the reserved blocks and calls ``on_prefilled``.
        Call it between steps, with no step in flight: the decode role runs with async scheduling
        off, and so must an embedding engine that calls it (``RunSpec.async_scheduling``).
        ``cache_salt``, ``lora``, ``mm_items``: as the prefill engine had them (``add_request``);
        ``cache`` as ``add_request`` takes it (from the store: it must read storage).
        RequestRejected if the request can never run."""
        if self._flight:
            raise ValueError("reserve_for_prefilled while a step is in flight: it needs async scheduling off "
                             "(RunSpec.async_scheduling=False; the decode role has it off)")
        req, ext, params = self._new_request(prompt, max_new_tokens, request_id, preemption, eos_token_id,
                                             stop_token_ids, arrival_time, sampling,
                                             (cache_salt, lora, tuple(mm_items)), cache)
        tail = None
        if from_store and not request_policy.reads(req.cache_policy, Tier.STORAGE):
            raise RequestRejected(ext, "cache.read must reach storage (device, host, storage) for a handoff "
                                       "through the store")
        if from_store:
            if not self.spec.enable_prefix_caching or self.lookups is None:
                raise ValueError("a handoff through the store needs a storage tier and prefix caching on")
            tokens, cache = req.token_ids[:req.num_prompt_tokens], self.cache
            keys = cache.keys_for(tokens, req.extra)
            cache.confirm_stored(keys[:(len(tokens) - 1) // cache.block_size])  # the handoff record says so
            tail = cache.tail_key(tokens, ext, keys)
        try:
            got = self.sched.reserve_for_prefilled(req, tail)
        except (TypeError, ValueError) as exc:
            raise RequestRejected(ext, str(exc).removeprefix(f"request {req.request_id}: ")) from None
        if isinstance(got, Refusal):
            return got._replace(request_id=ext)
        self._register(req, ext, params)
        if from_store:  # nothing else writes its blocks: it is prefilled once its loads are in
            self._from_store[req.request_id] = time.monotonic()
            if got.writable:
                self._arrived.append(req.request_id)
        return got._replace(request_id=ext)

    def on_prefilled(self, request_id: str, ok: bool = True) -> None:
        """The KV of a reserved request is in its blocks (``ok``), or its transfer failed and
        the prompt is recomputed here. ValueError for a request not waiting for it."""
        rid = self._ids.get(request_id)
        if rid is None:
            raise ValueError(f"request {request_id!r} is not reserved here")
        self.sched.on_prefilled(rid, ok)

    def _prefilled_from_store(self) -> None:
        """Requests whose handoff loads are in (SchedulerOutput.kv_writable) decode from here."""
        for rid in self._arrived:
            t0 = self._from_store.pop(rid)
            self.sched.on_prefilled(rid, True)
            req = self.sched.requests[rid]
            if self.handoff_stats is not None:
                st = self.handoff_stats
                st.requests += 1
                st.seconds += time.monotonic() - t0
                st.recomputed_prompt_tokens += max(0, req.num_prompt_tokens - 1 - req.num_computed_tokens)
        self._arrived = []

    def rejected(self, request_id: str, reason: str, arrival_time: float) -> RequestResult:
        """The result of a request ``add_request`` rejected, counted as finished."""
        self.metrics.observe_finished("rejected")
        self._sig.add("engine.finished", 1)
        return RequestResult(request_id, [], "rejected", float("nan"), time.monotonic() - arrival_time, 0, 0,
                             state="rejected", reason=reason)

    def abort(self, request_id: str) -> bool:
        """Abort a request whatever its state (waiting, loading, running, offloading,
        offloaded): its blocks are freed (at once, or when the step or the copy it is in
        ends) and it finishes with reason "aborted". False if the id is unknown or finished.
        Safe to call from any thread, like ``add_request`` (then it takes effect at the next step)."""
        with self._cond:  # re-entrant: _take_queued takes it again
            if threading.get_ident() != self._owner or self._stepping:
                if request_id not in self._ids:
                    return False
                self._aborts.append(request_id)
                self._cond.notify_all()
                return True
            self._late += self._take_queued()  # it may be among them
            return self._abort(request_id)

    def _abort(self, request_id: str) -> bool:
        rid = self._ids.get(request_id)
        if rid is not None and self.lookups is not None and self.lookups.abort(rid):
            return True
        return rid is not None and self.sched.abort(rid)

    def has_work(self) -> bool:
        """Requests unfinished (also queued by other threads), copies in flight, or releases
        the workers have not been sent yet."""
        return (self.sched.has_work() or self.transfer.pending > 0 or bool(self.lookups) or bool(self._arrived)
                or bool(self.exporter) or bool(self._incoming) or bool(self._aborts) or bool(self._release)
                or bool(self._late))

    def wait_for_work(self, timeout: float) -> bool:
        """The driving thread, with nothing to do: block until another thread adds or aborts a
        request, or ``timeout`` s pass; returns ``has_work()``. EngineStopped once the run's
        ``stop`` is set (a signal, ``Launch.stop``, a transfer process that cannot go on)."""
        self.beat()
        with self._cond:
            self._cond.wait_for(lambda: self._incoming or self._aborts or self._sig["stop"],
                                min(timeout, self.spec.heartbeat_s))
        self.beat()
        self._check_stop("waiting for work")
        return self.has_work()

    # ================================================================== the loop
    def beat(self) -> None:
        self._sig["engine.beat"] = time.monotonic_ns()

    def step(self) -> list[RequestResult]:
        """One iteration: plan, dispatch copies, run the step on the workers (or, when
        nothing can run, wait up to ``heartbeat_s`` for a copy); returns the requests
        that finished."""
        return self.step_stream().finished

    def step_stream(self) -> StepUpdate:
        """``step()``, also returning the tokens each request sampled in it (streaming: a
        request's last token comes in the update that lists it finished). The thread that
        calls it is the engine's driving thread."""
        with self._cond:  # from here, add_request and abort of other threads queue
            self._owner = threading.get_ident()
            self._stepping = True
        self._tokens = {}
        try:
            results, self._late = self._late, []
            results += self._take_queued()
            results += self._step()
        finally:
            self._stepping = False
        return StepUpdate(self._tokens, results)

    def _step(self) -> list[RequestResult]:
        self.gpu_clock.enter("schedule")
        self.beat()
        self._check_stop("between steps")  # a busy engine's waits never time out to look
        if time.monotonic() - self._last_check >= self.spec.heartbeat_s:
            self.check_workers()
        self._check_transfers()  # cheap when nothing is due; adopts restarted transfer processes
        if self.lookups is not None:
            self._lookup_wave()
        self._prefilled_from_store()
        if self.exporter:
            self.exporter.poll()
        results: list[RequestResult] = []
        if not self._flight:
            out, copies = self._plan(results)
            if out.plan.seqs:
                self._idle = 0
                self._send(out.plan)
            self._submit(copies)  # once the step is on its way
            if not out.plan.seqs:
                self._nothing_to_run(out)
        if self._overlaps():  # the next step goes out before this one's output is in
            self._await_lookups()
            out, copies = self._plan(results, overlap=True)
            if out.plan.seqs:
                self._send(out.plan)
                self.overlapped_steps += 1
            self._submit(copies)
            self.sync_plans += self.sched.sync_next
        if self._flight:
            self._apply(self._output(self._flight[0][0]))
            results += [self._result(r) for r in self.sched.take_finished()]  # with their last token
        if self.events is not None:
            self.events.flush()
        if self.checking:
            self.check()
        self.gpu_clock.enter("other")
        return results

    def _nothing_to_run(self, out: Any) -> None:
        """The plan has no step: tell the workers what finished, or wait for copies."""
        if self._release:  # idle: the workers forget the finished requests now, not at the next plan
            self._run(StepPlan(0, []))
        elif self.transfer.pending:
            self._idle = 0
            self.gpu_clock.enter("copies")
            self._pump(self.spec.heartbeat_s if self.lookups is None else self.lookups.wait_s(self.spec.heartbeat_s))
        elif self.sched.requests and not out.copies and not out.finished:
            self._idle += 1
            assert self._idle < _STALL_STEPS, f"scheduler stalled with no copy in flight: {self.sched.counts()}"

    def _plan(self, results: list[RequestResult], overlap: bool = False) -> tuple[Any, list[CopyPlan]]:
        """The scheduler's next step and its copies (for ``_submit`` once the step is sent)."""
        out = self.sched.step(overlap)
        self._arrived += [rid for rid in out.kv_writable if rid in self._from_store]
        copies = [ClearTask(p.plan_id, free_memory=True) if p.kind is CopyKind.CLEAR and self._free_memory
                  else p for p in out.copies]
        results += [self._result(r) for r in out.finished]
        return out, copies

    def _overlaps(self) -> bool:
        """Whether the next plan may go out while the one in flight runs: async scheduling on,
        one step in flight, no weight update under way, and the last plan left no preemption
        waiting on the step in flight."""
        return (self.async_scheduling and len(self._flight) == 1 and not self.sched.sync_next
                and self.sched.weight_update_state is WeightUpdate.NONE)

    def run(self) -> list[RequestResult]:
        """Step until every request has finished and no copy is in flight."""
        results: list[RequestResult] = []
        while self.has_work():
            results += self.step()
        return results

    def wait(self, timeout: float) -> None:
        """Idle (between arrivals): block up to ``timeout`` s on the inbox, handling copy
        completions as they come. Never sleeps without a doorbell to wake it."""
        self.beat()
        self.gpu_clock.enter("idle")
        self._pump(timeout)
        self.gpu_clock.enter("other")

    # ================================================================== control
    def update_weights(self, version: str, *, free_memory: bool = False) -> StepUpdate:
        """Switch the deployment to the weights ``version`` (RL: many times an hour). Returns
        what the steps it ran to drain produced, as one ``StepUpdate``: the tokens they sampled
        and the requests that finished meanwhile; a streaming caller handles it like any
        ``step_stream()`` update, or those tokens and results are never streamed. Admission
        pauses; running requests are preempted (their KV belongs to the old weights: they re-prefill under the new ones)
        and copies in flight finish; then every transfer rank clears (acks, no barrier: a
        rank's CLEAR ack means its earlier copies are done), the workers load ``version``
        (``protocol.load_weights_msg``), and admission resumes under the new storage
        namespace (RESTORE). ``free_memory``: the device tier's memory (workers) and the
        host tier's (transfer processes) go back to the system while the weights load
        (FastDeploy's FD_ENABLE_SWAP_SPACE_CLEARING); ``{worker,transfer}{r}.released_bytes``
        count it. EngineError if a worker fails to load; ValueError for the version in use."""
        version = str(version)
        if not version or version == self.weights_version:
            raise ValueError(f"weights version {version!r} is empty or the one in use")
        self.sched.begin_weight_update(drain=False)
        self._free_memory = bool(free_memory)
        drained = StepUpdate({}, [])
        try:
            while self.sched.weight_update_state is not WeightUpdate.READY:
                update = self.step_stream()
                for rid, tokens in update.tokens.items():
                    drained.tokens.setdefault(rid, []).extend(tokens)
                drained.finished.extend(update.finished)
        finally:
            self._free_memory = False
        self._run(StepPlan(0, []), control=protocol.load_weights_msg(version, free_memory))
        self.sched.finish_weight_update(version)  # RESTORE goes out with the next step's copies
        self.weights_version = version
        self.weight_updates += 1
        return drained

    def reset_prefix_cache(self) -> int:
        """Drop every cached block, in every tier, that no request holds (vLLM's call):
        later requests miss until the cache fills again. Running and preempted requests keep
        their KV. Returns the number of blocks dropped."""
        dropped = self.cache.reset_prefix_cache()
        if self.events is not None:
            self.events.flush()
        return dropped

    def wait_until_ready(self, timeout: float = 300.0) -> None:
        """Block until the run can serve: an empty plan (step 0) went through the workers
        (attached, runners built: the first real step's latency is the model's, not the
        start-up's) and every transfer rank is adopted (a copy submitted to a rank that is
        not up fails at once, and its request would recompute). EngineError after ``timeout``."""
        deadline = time.monotonic() + timeout
        self._run(StepPlan(0, []), timeout)
        while not self.transfer.ready():
            if time.monotonic() > deadline:
                raise EngineError(f"transfer processes not up within {timeout} s")
            self.beat()
            self._check_stop("waiting for the transfer processes")
            self._pump(self.spec.heartbeat_s)  # blocks on the doorbell: nothing else to do yet

    def _submit(self, copies: list[CopyPlan]) -> None:
        """Copies go to the transfer processes once the step is on its way: waking a transfer
        process can cost the engine its core for milliseconds on a busy host, which must not
        come between two steps (invariant 3 keeps copies off the blocks a step writes)."""
        for plan in copies:
            self.transfer.submit(plan)

    def _run(self, plan: StepPlan, timeout: float | None = None, control: PlanMsg | None = None) -> None:
        """One step (or ``control``, a request to every rank) through the workers, with no
        other step in flight."""
        assert not self._flight, f"step {self._flight[0][0].step_id} still in flight"
        self._send(plan, control)
        out = self._output(plan, timeout, control is not None)
        if plan.step_id:
            self._apply(out)
        else:
            self._flight.clear()

    def _send(self, plan: StepPlan, control: PlanMsg | None = None) -> None:
        new = {s.request_id: self._params.pop(s.request_id) for s in plan.seqs if s.request_id in self._params}
        if plan.step_id and control is None:
            self.gpu_clock.sent()
        try:
            msg = control or protocol.plan_to_msg(plan, self._release, new)
            landing = getattr(self.transfer, "landing", None)
            if control is None and landing is not None and plan.seqs:
                # its layers wait for the layered SWAP_INs still landing into its blocks (fastkv.transfer.landing)
                wait = landing.wait_for([s.block_table.reshape(-1) for s in plan.seqs])
                if wait is not None:
                    msg.wait_landed = wait
                    self.plans_on_landing += 1
            self._broadcast.send(msg, timeout=self.spec.dead_after_s)
        except ChannelClosed as exc:  # a worker let go of its plans: it is on its way out
            raise EngineError(self._worker_left(exc)) from exc
        except (PeerDied, PeerTimeout) as exc:
            raise EngineError(f"cannot send step {plan.step_id}: {exc}") from exc
        if control is None:
            self._release = []
        self._flight.append((plan, time.perf_counter()))

    def _output(self, plan: StepPlan, timeout: float | None = None, control: bool = False) -> OutputMsg:
        """Block until rank 0's output of ``plan`` (the oldest in flight) arrives, handling
        copy completions meanwhile."""
        t0 = time.perf_counter()
        while not self._outputs:
            if timeout is not None and time.perf_counter() - t0 > timeout:
                raise EngineError(f"no output for step {plan.step_id} within {timeout} s")
            msgs = self._recv(self.spec.heartbeat_s)
            if not msgs:
                self.beat()
                self._check_stop(f"step {plan.step_id} waited for the workers")
                self.check_workers()
                self._check_transfers()
            self._take(msgs, control)
        out = self._outputs.pop(0)
        assert out.step_id == plan.step_id, f"output of step {out.step_id} while step {plan.step_id} runs"
        return out

    def _take(self, msgs: list[Any], control: bool = False) -> None:
        """Copy completions are handled; step outputs are kept, in order, for ``_output``."""
        for msg in msgs:
            if isinstance(msg, DoneMsg):
                self._on_done(msg)
                continue
            if msg.error:
                raise EngineError(f"{'weight update' if control else f'step {msg.step_id}'} failed: {msg.error}")
            if msg.step_id and not control:
                self.gpu_clock.received(msg.seconds)
            self._outputs.append(msg)

    def _await_lookups(self) -> None:
        """Async scheduling, before the next plan: while the step in flight runs, wait for the
        storage lookups of the requests that just arrived, so that they join this plan and not
        the one after it (a step later). Never past that step's output, nor past the lookups'
        own deadline: the workers wait for none of it."""
        lookups = self.lookups
        if lookups is None or not lookups.blocked():
            return
        while not self._outputs and lookups.blocked() and (wait := lookups.wait_s(self.spec.heartbeat_s)) > 0:
            self.beat()
            self._take(self._recv(wait))
        self._lookup_wave()

    def _apply(self, out: OutputMsg) -> None:
        """The oldest step in flight is done: its tokens go to the scheduler and the caller.
        Its wall time runs from when it was sent, or from the output before it if that came
        later (the workers ran the steps back to back)."""
        _, sent = self._flight.pop(0)
        self.gpu_clock.enter("schedule")
        now = time.perf_counter()
        applied = self.sched.on_step_output(protocol.msg_to_output(out))
        for rid, tok in applied.items():
            ext = self._ext[rid]
            req = self.sched.requests.get(rid)
            held = req is not None and req.finish_pending is not None  # its result comes with the next output
            (self._held if held else self._tokens).setdefault(ext, []).append(tok)
            seen = self._sampled_by.setdefault(rid, [])
            if not seen or seen[-1] != self.weights_version:
                seen.append(self.weights_version)
        wall = now - max(sent, self._last_output)
        self.step_wall_s += wall
        self.metrics.observe_step(wall, len(applied))
        self._last_output = now

    def _pump(self, timeout: float) -> None:
        msgs = self._recv(timeout)
        if not msgs:
            self.check_workers()
            self._check_transfers()
        for msg in msgs:
            assert isinstance(msg, DoneMsg), f"unexpected {type(msg).__name__} with no step in flight"
            self._on_done(msg)

    def _recv(self, timeout: float) -> list[Any]:
        try:
            return self.ends.inbox.recv_many(256, timeout)
        except ChannelClosed as exc:
            if exc.role != "worker":
                raise
            raise EngineError(self._worker_left(exc)) from exc
        except PeerDied as exc:
            if exc.role == "worker":
                raise EngineError(self._worker_gone(exc.rank, exc.pid)) from exc
            if exc.role != "transfer":
                raise EngineError(f"{exc.role}[{exc.rank}] pid {exc.pid} died: {exc}") from exc
            # Its tasks fail (their requests recompute); the client takes its done channel out
            # of the inbox, and back in once the supervisor's replacement is adopted.
            for res in self.transfer.on_peer_died(exc):
                self._copy_result(res)
            return []

    # ================================================================== copies
    def _lookup_wave(self) -> None:
        """Ask storage about the requests parked since the last step; queue the answered ones."""
        for plan in self.lookups.wave():
            self.transfer.submit(plan)
        for req, aborted in self.lookups.release():
            self.sched.add_request(req)
            if aborted:
                self.sched.abort(req.request_id)

    def _on_done(self, msg: DoneMsg) -> None:
        if self.lookups is not None:
            self.lookups.on_ack(msg)
        for res in self.transfer.on_done(msg):
            self._copy_result(res)

    def _copy_result(self, res: Any) -> None:
        if self.lookups is not None and self.lookups.owns(res.plan.plan_id):
            self.lookups.complete(res.plan.plan_id, res.ok, self.spec.tp_size)
            return
        # The scheduler's cost model wants per-rank bytes; the client reports all ranks'.
        # a layered SWAP_IN's ack comes before its copy: its time says nothing of the link (0: not observed)
        seconds = 0.0 if getattr(res, "layered", False) else res.seconds
        self.sched.on_copy_complete(res.plan.plan_id, res.ok, res.nbytes // self.spec.tp_size, seconds)
        self.metrics.observe_copy(res.plan.kind.name.lower(), res.ok, res.nbytes, res.seconds)
        if self.exporter:
            self.exporter.poll()

    def _check_transfers(self) -> None:
        for res in self.transfer.check():
            self._copy_result(res)

    def _check_stop(self, where: str) -> None:
        # A peer that died before it bound its channel end cannot be seen as dead: the
        # supervisor saw it and set stop.
        if self._sig["stop"]:
            raise EngineStopped(f"stop requested while {where}")

    def check_workers(self) -> None:
        """EngineError if a worker process is gone (a rank > 0 has no output channel to say so),
        naming it, how it ended and its log's last line. ``fastkv.launch`` records a worker's
        pid when it spawns it, so one that dies before it attaches is seen too."""
        self._last_check = time.monotonic()
        for r in range(self.spec.tp_size):
            pid = self._sig[f"worker{r}.pid"]
            if pid and not pid_alive(pid):
                raise EngineError(self._worker_gone(r, pid))

    def _worker_left(self, exc: ChannelClosed) -> str:
        """A worker closed its end of a channel (it failed and is exiting): how it ended, once it
        has (at most ``dead_after_s`` later)."""
        if exc.role != "worker" or not exc.pid:
            return str(exc)
        if not wait_exit(exc.pid, self.spec.dead_after_s):
            return f"worker{exc.rank} (rank {exc.rank}, pid {exc.pid}) closed its channels and still runs"
        return self._worker_gone(exc.rank, exc.pid)

    def _worker_gone(self, rank: int, pid: int) -> str:
        code = exit_status(pid)  # known while the process is a zombie of ours (fastkv.launch)
        log = Path(self.spec.out_dir) / "logs" / f"worker{rank}.log"
        return (f"worker{rank} (rank {rank}, pid {pid}) {'died' if code is None else describe_exit(code)}; "
                f"{log}: {last_line(log)}")

    # ================================================================== health
    def health(self) -> dict[str, Any]:
        """What the engine holds and has done, now: ``blocks`` per tier (``device``, ``host``)
        and state (``free``, ``allocated``, ``cached``, ``in_flight``), ``requests`` per state
        (``queued``, ``waiting``, ``loading``, ``running``, ``offloading``, ``offloaded``: the
        unfinished ones), ``copies_in_flight``, ``weights_version`` and ``counters``, the run's
        counters as summary.json has them (docs/FORMATS.md). Call it from the thread that
        drives the engine, between steps."""
        with self._cond:
            queued = len(self._incoming)
        return health.snapshot(self, queued + (len(self.lookups.requests()) if self.lookups is not None else 0))

    def check(self) -> None:
        """AssertionError naming the first broken invariant of the scheduler or the cache (every
        block's owner, state and tier agree; nothing held that no request or copy holds). From
        the driving thread, between steps."""
        self.sched.check_integrity()
        self.cache.check_integrity()

    # ================================================================== results
    def _result(self, req: Request) -> RequestResult:
        with self._cond:
            ext = self._ext.pop(req.request_id)
            del self._ids[ext]
            self._params.pop(req.request_id, None)
        self._release.append(req.request_id)
        held = self._held.pop(ext, None)
        if held:  # a request's last token comes in the update that lists it finished
            self._tokens.setdefault(ext, []).extend(held)
        finish = FINISH[req.state]
        self.metrics.observe_finished(finish)
        self._sig.add("engine.finished", 1)
        result = self._snapshot(ext, req, finish, req.finish_time)
        self._sampled_by.pop(req.request_id, None)
        return result

    def unfinished(self) -> list[RequestResult]:
        """The requests not finished yet, as results (``state`` "unfinished", output so far):
        what a stopped or failed run reports for them."""
        now = time.monotonic()
        parked = self.lookups.requests() if self.lookups is not None else []
        return [self._snapshot(self._ext[req.request_id], req, "unfinished", now)
                for req in [*self.sched.requests.values(), *parked]]

    def _snapshot(self, ext: str, req: Request, finish: str, end: float) -> RequestResult:
        t0 = req.arrival_time
        ttft = req.first_token_time - t0 if req.first_token_time is not None else float("nan")
        state = "finished" if finish in ("length", "stop") else finish
        return RequestResult(ext, list(req.output_token_ids), finish, ttft, end - t0, req.num_preemptions,
                             req.num_recomputed_tokens, state,
                             weights_version="+".join(self._sampled_by.get(req.request_id, ())))

    def close(self) -> None:
        """Send the workers the last releases, close this engine's channel ends (workers and
        transfer processes see a clean shutdown) and the metrics endpoint. The supervisor
        (or ``fastkv.launch``) unlinks the objects."""
        if self._release:  # not waiting for an answer: the workers see the channel close next
            last, self._release = self._release, []
            # workers already gone keep no per-request state to forget
            with contextlib.suppress(PeerDied, PeerTimeout, ChannelClosed):
                self._broadcast.send(protocol.plan_to_msg(StepPlan(0, []), last), timeout=self.spec.heartbeat_s)
        self.metrics.close()
        if self.events is not None:
            self.events.close()
        self.ends.close()
        if self._ns is not None:
            self._ns.close()

"""One run of fastkv: its spec and its channel topology.

The supervisor writes a ``RunSpec`` (JSON) and creates every shared object of the run
with ``create_run``; each process reads the spec and attaches only the ends it uses:

| object                 | creator    | producer -> consumer            |
|------------------------|------------|---------------------------------|
| ``task.{r}``           | supervisor | engine -> transfer[r]           |
| ``done.{r}``           | supervisor | transfer[r] -> engine (doorbell ``engine.in``) |
| ``plan.{r}``           | supervisor | engine -> worker[r]             |
| ``output``             | supervisor | worker[0] -> engine (doorbell ``engine.in``)   |
| ``signals``            | supervisor | heartbeats, pids, ready flags (``SIGNALS`` below) |
| ``landed.{r}`` (sem)   | supervisor | transfer[r] -> worker[r]: a layered SWAP_IN's layer landed (``ipc.landed``) |
| ``coll`` (tp > 1)      | supervisor | worker[r] <-> worker[s]: ``ShmCollective`` of the tp group |
| ``kvdev{r}``/``kvhost{r}`` | supervisor | KV tiers of rank r (``fastkv.transfer.tiers``; hybrid: ``kvhost{r}g{g}``) |

The KV tiers are created by the supervisor on a CPU build so that they outlive any child
(a restarted transfer process re-attaches); on a GPU build the worker allocates the device
tier and shares it by CUDA IPC. Every name is under the run's namespace and manifest, so
``fastkv-supervisor --cleanup`` removes a crashed run completely.
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from fastkv.config import KVLayout
from fastkv.ipc import Channel, DoneMsg, Doorbell, Inbox, Namespace, OutputMsg, PlanMsg, SignalArray, TaskMsg, landed
from fastkv.ipc.collective import ShmCollective


@dataclass(frozen=True)
class RunSpec:
    """Everything a process of the run needs to know; JSON round-trips exactly."""

    run_id: str
    layout: KVLayout
    num_device_blocks: int
    num_host_blocks: int
    # a sliding-window hybrid layout: device blocks per KV cache group (KVLayout.groups, sized
    # by fastkv.cache.groups.split_device_tier); () every group num_device_blocks
    group_blocks: tuple[int, ...] = ()
    storage_url: str = ""  # "" = no storage tier; e.g. lmdb:///path or redis://host:port
    runner: str = "synthetic"  # fastkv.engine.runners.runner_class name
    runner_options: dict[str, Any] = field(default_factory=dict)
    model_id: str = "fastkv-demo"
    weights_version: str = "0"  # the weights the run starts with (any string; the tiny runner hashes it to a seed)
    # weight updates the engine process makes: "N:VERSION" = after N requests finished, switch to VERSION
    update_weights_at: tuple[str, ...] = ()
    free_memory_on_update: bool = False  # release the device and host tiers' memory during each update
    enable_prefix_caching: bool = True  # False: a request only ever hits its own KV (after a preemption)
    role: str = "mixed"  # "prefill" | "decode" | "mixed": disaggregated serving (fastkv.engine.handoff)
    handoff: str = ""  # decode: the prefill run's handoff.jsonl
    device_ids: tuple[int, ...] = ()  # accelerator of each rank (``device_id``); empty: rank r uses device r
    cache_policy: str = "write_back"  # fastkv.cache.write_policy.WritePolicy value
    storage_writes: str = "through"  # fastkv.cache.write_policy.StorageWrites name: which blocks are stored
    eviction: str = "lru"  # fastkv.cache.eviction.POLICIES name
    scheduler: dict[str, Any] = field(default_factory=dict)  # SchedulerConfig keyword arguments
    # plan and send step N+1 while the workers run step N (fastkv.engine.core); False: one step at a time
    async_scheduling: bool = True
    # host -> device copies a step waits for land layer by layer, and the step's layer l starts once
    # its layer l landed (``fastkv.ipc.landed``); False: the step waits for the whole copy
    layerwise_load: bool = True
    # the engine thread's Linux scheduling policy (fastkv.procs.cpu_policy): "batch" keeps its
    # wake-ups from preempting the worker that woke it; "normal" is the default SCHED_OTHER
    engine_cpu_policy: str = "batch"
    ops_threads: int = 1  # CPU swap-op threads per transfer process
    host_checksums: bool = True  # checksum host blocks on arrival, check before they leave (a mismatch: recompute)
    heartbeat_s: float = 0.5  # each process beats at least this often
    dead_after_s: float = 5.0  # a silent heartbeat for this long counts as a dead process
    task_timeout_s: float = 60.0  # a copy task unfinished after this fails (its request recomputes)
    # a new request waits at most this long for the storage tier to say what it holds (fastkv.engine.lookup)
    storage_lookup_timeout_s: float = 0.2
    # what admission does with a lookup in flight (fastkv.engine.lookup): "timeout" waits at most
    # storage_lookup_timeout_s + prefetch_timeout_per_1k_tokens_s per 1,000 prompt tokens,
    # "best_effort" not at all, "wait_complete" for the answer
    prefetch_policy: str = "timeout"
    prefetch_timeout_per_1k_tokens_s: float = 0.0
    # which host and storage hits admission loads (fastkv.sched.hits): "auto", "load" or "recompute"
    hit_policy: str = "auto"
    # STORE blocks in flight past which the write policies' optional STOREs are skipped and counted
    storage_backlog_blocks: int = 256
    slot_size: int = 512  # ring slot bytes; larger messages span slots
    nslots: int = 4096
    out_dir: str = "fastkv-out"
    metrics_port: int = 0  # the engine's Prometheus endpoint; 0 = off
    metrics_linger_s: float = 3.0  # the endpoint stays up this long after the workload is done (a final scrape)
    kv_events: dict[str, Any] = field(default_factory=dict)  # fastkv.events.EventsConfig fields; no endpoint = off

    def __post_init__(self) -> None:
        if self.num_device_blocks <= 0 or self.num_host_blocks < 0:
            raise ValueError("RunSpec: num_device_blocks must be > 0 and num_host_blocks >= 0")
        if self.heartbeat_s <= 0 or self.dead_after_s <= self.heartbeat_s or self.task_timeout_s <= 0:
            raise ValueError("RunSpec: need heartbeat_s > 0, dead_after_s > heartbeat_s, task_timeout_s > 0")
        backlog = self.storage_backlog_blocks
        if isinstance(backlog, bool) or not isinstance(backlog, int) or backlog < 0:
            raise ValueError(f"RunSpec: storage_backlog_blocks must be an int >= 0, got {backlog!r}")
        if not self.storage_lookup_timeout_s >= 0:
            raise ValueError(f"RunSpec: storage_lookup_timeout_s must be >= 0, got {self.storage_lookup_timeout_s!r}")
        if not self.prefetch_timeout_per_1k_tokens_s >= 0:
            raise ValueError("RunSpec: prefetch_timeout_per_1k_tokens_s must be >= 0, "
                             f"got {self.prefetch_timeout_per_1k_tokens_s!r}")
        from fastkv.sched.hits import HIT_POLICIES
        from fastkv.sched.prefetch import PREFETCH_POLICIES

        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"RunSpec: prefetch_policy must be one of {PREFETCH_POLICIES}, "
                             f"got {self.prefetch_policy!r}")
        if self.hit_policy not in HIT_POLICIES:
            raise ValueError(f"RunSpec: hit_policy must be one of {HIT_POLICIES}, got {self.hit_policy!r}")
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"RunSpec: metrics_port must be in [0, 65536), got {self.metrics_port}")
        if not 0 <= self.metrics_linger_s < 3600:
            raise ValueError(f"RunSpec: metrics_linger_s must be in [0, 3600) seconds, got {self.metrics_linger_s}")
        if self.layout.mla and self.runner != "tiny":
            raise ValueError(f"RunSpec: an MLA layout needs runner 'tiny' (the runner with MLA attention), "
                             f"got {self.runner!r}")
        object.__setattr__(self, "group_blocks", tuple(self.group_blocks))
        self.layer_blocks()  # checks group_blocks
        if self.group_blocks and not self.layout.is_hybrid:
            raise ValueError("RunSpec: group_blocks is for a sliding-window hybrid layout (KVLayout.windows)")
        if self.layout.is_hybrid:
            self._check_hybrid()
        object.__setattr__(self, "update_weights_at", tuple(self.update_weights_at))
        self.events_config()
        object.__setattr__(self, "device_ids", tuple(self.device_ids))
        if self.device_ids and (len(self.device_ids) != self.tp_size or len(set(self.device_ids)) != self.tp_size
                                or min(self.device_ids) < 0):
            raise ValueError(f"RunSpec: device_ids must name {self.tp_size} distinct devices >= 0, "
                             f"got {list(self.device_ids)}")
        self.weight_updates()

    def layer_blocks(self) -> tuple[int, ...]:
        """Device blocks of each layer's tensors (``KVLayout.layer_blocks``)."""
        return self.layout.layer_blocks(self.group_blocks, self.num_device_blocks)

    def device_group_blocks(self) -> tuple[int, ...]:
        """Device blocks of each KV cache group (every group ``num_device_blocks`` unless given)."""
        return self.group_blocks or (self.num_device_blocks,) * len(self.layout.groups)

    def host_group_blocks(self) -> tuple[int, ...]:
        """A hybrid's host blocks per KV cache group (a segment each, ``HostTier`` ``group``): the
        bytes of ``num_host_blocks`` blocks of every layer, split in the device tier's proportion.
        () for the all-full layout or without a host tier."""
        if not self.layout.is_hybrid or not self.num_host_blocks:
            return ()
        return tuple(max(1, n * self.num_host_blocks // self.num_device_blocks) for n in self.device_group_blocks())

    def host_tiers(self) -> list[tuple[int | None, KVLayout, int]]:
        """A rank's host segments, as (KV cache group or None, layout, blocks): one of every layer,
        or a hybrid's one per group of that group's layers (``fastkv.transfer.tiers``)."""
        if self.layout.is_hybrid:
            return [(g, self.layout.group_layout(g), n) for g, n in enumerate(self.host_group_blocks())]
        return [(None, self.layout, self.num_host_blocks)] if self.num_host_blocks else []

    def _check_hybrid(self) -> None:
        """What a sliding-window hybrid layout does not run with yet, refused by its flag: those
        paths would move or key every layer's blocks as one (docs/DESIGN.md, KV cache groups); KV
        events only in the schema whose events carry their group. A host tier is per group, for
        preemption by offload (``host_group_blocks``)."""
        from fastkv.events.config import SCHEMAS

        schema = self.kv_events.get("schema", SCHEMAS[0])
        refused = [("--storage", bool(self.storage_url)),
                   ("--role", self.role != "mixed"), ("--update-weights-at", bool(self.update_weights_at)),
                   (f"--kv-events-schema {schema} (its events cannot name a block's KV cache group: use vllm)",
                    bool(self.kv_events) and schema != "vllm"),
                   ("--kv-layout mla", self.layout.mla)]
        for flag, used in refused:
            if used:
                raise ValueError(f"{flag}: not supported for a sliding-window hybrid layout yet "
                                 "(--kv-cache-groups off caches every layer in full)")

    def events_config(self):
        """The KV event settings (fastkv.events), topic ``kv@<run id>@<model id>`` unless given;
        None when off. ValueError naming a bad or unknown setting, or the missing extra."""
        if not self.kv_events:
            return None
        from fastkv.events.config import EventsConfig

        try:
            cfg = EventsConfig(**{"topic": f"kv@{self.run_id}@{self.model_id}", **self.kv_events})
        except TypeError:
            known = sorted(EventsConfig.__dataclass_fields__)
            raise ValueError(f"RunSpec.kv_events: unknown setting in {sorted(self.kv_events)}; "
                             f"known: {known}") from None
        if not cfg.enabled:
            return None
        missing = cfg.missing_modules()
        if missing:
            raise ValueError(missing)
        return cfg

    def device_id(self, rank: int) -> int:
        """The accelerator rank ``rank`` of this node uses: ``device_ids[rank]``, else ``rank``. An
        index among the visible devices, so ``CUDA_VISIBLE_DEVICES`` decides which physical ones."""
        _check_rank(self, rank)
        return self.device_ids[rank] if self.device_ids else rank

    def weight_updates(self) -> list[tuple[int, str]]:
        """``update_weights_at`` as (finished requests, version), in order; ValueError naming a bad entry."""
        out, version = [], self.weights_version
        for item in self.update_weights_at:
            n, sep, new = str(item).partition(":")
            if not sep or not n.isdigit() or not new or new == version:
                raise ValueError(f"update_weights_at: expected N:VERSION with N >= 0 and a VERSION other than the "
                                 f"one before ({version!r}), got {item!r}")
            if out and int(n) < out[-1][0]:
                raise ValueError(f"update_weights_at: {item!r} comes after {out[-1][0]} finished requests")
            out.append((int(n), new))
            version = new
        return out

    @property
    def tp_size(self) -> int:
        return self.layout.tp_size

    @property
    def tier_prefix(self) -> str:
        """Name prefix for ``fastkv.transfer.tiers`` (``fkv.<run_id>.``)."""
        return f"fkv.{self.run_id}."

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        doc = json.loads(text)
        if not isinstance(doc, dict):
            raise ValueError("RunSpec JSON must be an object")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(doc) - known
        if unknown:
            raise ValueError(f"RunSpec: unknown fields {sorted(unknown)}")
        doc["layout"] = KVLayout(**doc["layout"])
        return cls(**doc)

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        path.write_text(self.to_json())
        return path

    @classmethod
    def load(cls, path: str | Path) -> RunSpec:
        return cls.from_json(Path(path).read_text())


# What a runner verified (``ModelRunner.checks``), published by each worker after every step.
# kv_stale_hits: KV read under the current weights that was computed under older ones.
# synthetic_us: time the synthetic runner spent making, checking and reading its KV bytes, a stand-in
# for what a GPU does inside the modelled step time (bench_e2e takes it out of the wall time).
VERIFY_COUNTERS = ("kv_blocks_verified", "kv_requests_verified", "kv_positions_read", "kv_mismatches",
                   "kv_stale_hits", "synthetic_us")


HANDOFF_FILE = "handoff.jsonl"

# ``{proc}.ready``: what the supervisor may do to a process it must stop. STARTING (importing,
# attaching: it holds no work and sees ``stop`` only once up) may be SIGTERMed; READY and EXITING
# (its channels closed, it is releasing what it attached) are left to exit by themselves: a
# SIGTERM mid-cleanup runs Paddle's SIGTERM dump, which can hang the process until SIGKILL.
STARTING, READY, EXITING = 0, 1, 2


def signal_names(tp_size: int) -> list[str]:
    """Slots of the run's signal array: per process a heartbeat (monotonic ns), its pid and
    its ready flag (STARTING, READY, EXITING); ``stop`` asks every process to exit; ``transfer{r}.gen`` counts restarts
    (the supervisor bumps it before starting a replacement); ``engine.total`` (requests in
    the workload) and ``engine.finished`` (requests done) drive the supervisor's progress bar;
    ``storage.errors`` and ``storage.corrupt`` count the storage faults of every transfer
    process (failed operations, values that failed verification) for the engine's summary.
    Counters for the summary: ``worker{r}.<VERIFY_COUNTERS>`` and
    ``transfer{r}.host_checksum_mismatches`` (kept across transfer restarts), and the bytes
    of memory each worker (device tier) and transfer process (host tier) gave back during
    weight updates with free_memory (``{worker,transfer}{r}.released_bytes``). ``transfer{r}.landed``:
    the layers of layered SWAP_INs on rank r's device (``fastkv.ipc.landed``)."""
    names = ["stop"]
    procs = ["engine"] + [f"worker{r}" for r in range(tp_size)] + [f"transfer{r}" for r in range(tp_size)]
    for p in procs:
        names += [f"{p}.beat", f"{p}.pid", f"{p}.ready"]
    names += [f"transfer{r}.gen" for r in range(tp_size)]
    names += [f"worker{r}.{c}" for r in range(tp_size) for c in VERIFY_COUNTERS]
    names += [f"transfer{r}.host_checksum_mismatches" for r in range(tp_size)]
    names += [f"{p}{r}.released_bytes" for p in ("worker", "transfer") for r in range(tp_size)]
    names += ["engine.total", "engine.finished", "storage.errors", "storage.corrupt"]
    names += [landed.slot(r) for r in range(tp_size)]
    return names


def collective_prefix(spec: RunSpec) -> str:
    """Name prefix of the workers' ``ShmCollective`` (exists only when tp_size > 1)."""
    return f"fkv.{spec.run_id}.coll"


def handoff_file(spec: RunSpec) -> Path:
    """The prefill run's record of its handoffs, which the decode run follows."""
    return Path(spec.handoff) if spec.handoff else Path(spec.out_dir) / HANDOFF_FILE


def handoff_sem(path: str | Path) -> str:
    """The semaphore the prefill run posts per line of ``path``: named after the file, so two
    runs find it whichever starts first."""
    digest = hashlib.sha256(str(Path(path).resolve()).encode()).hexdigest()[:16]
    return f"/fkv.pd{digest}.handoff"


def create_run(ns: Namespace, spec: RunSpec) -> None:
    """Owner side: create every channel, the engine's doorbell and the signal array.
    The creator keeps no ends open: each process attaches what it uses."""
    if spec.run_id != ns.run_id:
        raise ValueError(f"spec.run_id {spec.run_id!r} != namespace {ns.run_id!r}")
    bell = Doorbell.create(ns, "engine.in")
    opened = [bell, SignalArray.create(ns, "signals", signal_names(spec.tp_size))]
    kw = dict(slot_size=spec.slot_size, nslots=spec.nslots)
    for r in range(spec.tp_size):
        opened += [Channel.create(ns, f"task.{r}", **kw), Channel.create(ns, f"done.{r}", bell=bell, **kw),
                   Channel.create(ns, f"plan.{r}", **kw), ns.create_sem(landed.sem_name(r))]
    opened.append(Channel.create(ns, "output", bell=bell, **kw))
    if spec.tp_size > 1:  # the tensor-parallel workers' all-gather; listed first, so cleanup finds it
        ns.record("shm", "coll")
        for name in ShmCollective.names(collective_prefix(spec), spec.tp_size)[1:]:
            ns.record("sem", name.removeprefix(f"/{ns.prefix}."))
        coll = ShmCollective.create(collective_prefix(spec), spec.tp_size, slot_bytes=1 << 20)
        coll.disown()  # the namespace unlinks it
        opened.append(coll)
    if spec.role != "mixed":  # shared with the other role's run: both unlink it (fastkv.engine.handoff_stream)
        ns.record_shared("sem", handoff_sem(handoff_file(spec)))
    for obj in opened:
        obj.close()


class EngineEnds(NamedTuple):
    tasks: list[Channel]  # send TaskMsg to transfer[r]
    plans: list[Channel]  # send PlanMsg to worker[r]
    inbox: Inbox  # DoneMsg from every transfer[r] and OutputMsg from worker[0], one doorbell
    dones: list[Channel]
    output: Channel
    bell: Doorbell
    signals: SignalArray

    def close(self) -> None:
        for ch in (*self.tasks, *self.plans, *self.dones, self.output):
            ch.close()
        self.bell.close()
        self.signals.close()


def attach_engine(ns: Namespace, spec: RunSpec) -> EngineEnds:
    bell = Doorbell.attach(ns, "engine.in")
    tp = spec.tp_size
    tasks = [Channel.attach(ns, f"task.{r}", accept=[TaskMsg]).bind("send", "engine") for r in range(tp)]
    plans = [Channel.attach(ns, f"plan.{r}", accept=[PlanMsg]).bind("send", "engine") for r in range(tp)]
    dones = [Channel.attach(ns, f"done.{r}", bell=bell, accept=[DoneMsg]).bind("recv", "engine") for r in range(tp)]
    output = Channel.attach(ns, "output", bell=bell, accept=[OutputMsg]).bind("recv", "engine")
    return EngineEnds(tasks, plans, Inbox([*dones, output], bell), dones, output, bell,
                      SignalArray.attach(ns, "signals"))


class TransferEnds(NamedTuple):
    task: Channel  # receive TaskMsg
    done: Channel  # send DoneMsg
    signals: SignalArray

    def close(self) -> None:
        self.task.close()
        self.done.close()
        self.signals.close()


def attach_transfer(ns: Namespace, spec: RunSpec, rank: int) -> TransferEnds:
    _check_rank(spec, rank)
    return TransferEnds(
        Channel.attach(ns, f"task.{rank}", accept=[TaskMsg]).bind("recv", "transfer", rank),
        Channel.attach(ns, f"done.{rank}", accept=[DoneMsg]).bind("send", "transfer", rank),
        SignalArray.attach(ns, "signals"),
    )


class WorkerEnds(NamedTuple):
    plan: Channel  # receive PlanMsg
    output: Channel | None  # send OutputMsg (rank 0 only)
    signals: SignalArray

    def close(self) -> None:
        self.plan.close()
        if self.output is not None:
            self.output.close()
        self.signals.close()


def attach_worker(ns: Namespace, spec: RunSpec, rank: int) -> WorkerEnds:
    _check_rank(spec, rank)
    output = Channel.attach(ns, "output", accept=[OutputMsg]).bind("send", "worker", 0) if rank == 0 else None
    return WorkerEnds(Channel.attach(ns, f"plan.{rank}", accept=[PlanMsg]).bind("recv", "worker", rank), output,
                      SignalArray.attach(ns, "signals"))


def _check_rank(spec: RunSpec, rank: int) -> None:
    if not isinstance(rank, int) or not 0 <= rank < spec.tp_size:
        raise ValueError(f"rank must be an int in [0, {spec.tp_size}), got {rank!r}")

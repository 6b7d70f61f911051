"""``fastkv-supervisor``: run a workload through fastkv and write its report.

    fastkv-supervisor                                  # the demo, CPU, LMDB, under memory pressure
    fastkv-supervisor --config job.toml --tp 2 --preemption recompute --workload trace:64
    fastkv-supervisor --cleanup                        # remove what crashed runs left in /dev/shm

Settings: flag > config file > default. A flag overrides the config file (``--config``, TOML
or JSON, keys = ``JobConfig`` field names; tables ``runner_options``, ``scheduler``, ``demo``),
which overrides the defaults (``JobConfig``), whichever of a setting's names each uses
(``swap_space`` / ``num_cpu_blocks`` / ``host_blocks``; ``kvcache_storage_backend`` / ``storage``);
one layer giving two names of one setting is an error. Bad values are rejected up front, naming
the setting.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import secrets
import signal
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

from fastkv.cache.eviction import POLICIES
from fastkv.cli.outdir import OutDir
from fastkv.config import KVLayout
from fastkv.events.config import SCHEMAS as EVENT_SCHEMAS
from fastkv.native.compiled import NotBuilt
from fastkv.procs.cpu_policy import CPU_POLICIES
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.hits import HIT_POLICIES
from fastkv.sched.prefetch import PREFETCH_POLICIES
from fastkv.workload import PREEMPTION_MODES, ConversationConfig

RUNNERS = ("synthetic", "tiny", "paddleformers:llama", "paddleformers:ernie4_5", "paddleformers:gemma3",
           "paddleformers:gpt_oss")
STORAGE_SCHEMES = ("lmdb", "redis", "rediss", "unix", "mooncake")
ROLES = ("mixed", "prefill", "decode")
# Per-token compute cost of the synthetic runner (CPU busy work): 300 us, the order of what the
# tiny Paddle decoder costs per token on a CPU, so recomputing a preempted request costs
# what it would with a real (CPU) model. verify "resumed" checks every block of a request that
# was restored, preempted or moved, byte for byte, without re-reading every sequence every step.
DEFAULT_RUNNER_OPTIONS = {"synthetic": {"compute_us_per_token": 300.0, "verify": "resumed"}, "tiny": {},
                          **{name: {} for name in RUNNERS if name.startswith("paddleformers:")}}
CACHE_POLICIES = ("write_back", "write_through", "write_through_selective")
STORAGE_WRITES = ("preempted", "through", "back")  # fastkv.cache.storage_writes: what each costs
QUICK_DEMO = {"conversations": 8, "turns": 3}
DEMO_DEVICE_BLOCKS = 64  # the demo's conversations need several times this: memory pressure
AUTO_DEVICE_BYTES = 1 << 30  # the most device tier per rank a workload's longest request sizes by default
RUNNER_VOCAB = 1024  # both reference runners' default vocab (runner option "vocab", tiny: config.vocab)


@dataclass(frozen=True)
class JobConfig:
    """One supervisor job. Capacities are in blocks of ``block_size`` tokens, per rank."""

    tp: int = 1
    block_size: int = 16
    layers: int = 4
    kv_heads: int = 2  # per rank
    head_dim: int = 64
    dtype: str = "float32"
    # 0: the workload's default: DEMO_DEVICE_BLOCKS, or room for the longest request of a trace or a file
    device_blocks: int = 0
    host_blocks: int = 1024  # 0 = no host tier
    # "default": lmdb://<out>/store, fresh every run (none without a host tier); "none": no storage tier
    storage: str = "default"
    preemption: str = "offload"
    # host tier: write_through copies full blocks as they fill, so evicting them never waits for a
    # copy (write_back makes the request that evicts wait for the block's copy to the host)
    cache_policy: str = "write_through"
    # which blocks reach the storage tier: "through" (every block once on the host) makes the pool
    # useful to restarts and other engines; "preempted" and "back" write less
    storage_write: str = "through"
    eviction: str = "lru"  # the order cached blocks leave a tier: lru | lfu
    host_checksums: bool = True  # checksum host blocks (a corrupt one is recomputed, never served)
    async_scheduling: str = "on"  # "on": the engine sends step N+1 while the workers run step N; "off"
    # "batch": the engine's wake-ups never preempt the worker that woke it (SCHED_BATCH); "normal"
    engine_cpu_policy: str = "batch"
    runner: str = "synthetic"
    workload: str = "demo"  # demo | trace | trace:N | path to a workload.jsonl
    seed: int = 0
    out: str = "fastkv-out"
    metrics_port: int = 0
    metrics_linger_s: float = 3.0  # the endpoint stays up this long after the run (its final scrape)
    heartbeat_s: float = 0.5
    dead_after_s: float = 5.0
    task_timeout_s: float = 60.0
    storage_lookup_timeout_s: float = 0.2  # a new request waits at most this long for its storage lookup
    # STOREs in flight past which the write policy's optional ones are skipped (storage falls behind)
    storage_backlog_blocks: int = 256
    # what a new request does while its lookup is out (fastkv.sched.prefetch): "timeout" waits at most
    # storage_lookup_timeout_s + prefetch_timeout_per_1k_tokens_s per 1,000 prompt tokens
    prefetch_policy: str = "timeout"
    prefetch_timeout_per_1k_tokens_s: float = 0.0
    # which host and storage hits are loaded (fastkv.sched.hits): "auto" those whose copy beats a recompute
    hit_policy: str = "auto"
    quick: bool = False
    weights_version: str = "0"  # the weights the run starts with (the tiny runner hashes it to a seed)
    update_weights_at: str = ""  # "N:VERSION[,N:VERSION...]": switch weights after N requests finished
    free_memory_on_update: bool = False  # release the device and host tiers' memory during each update
    enable_prefix_caching: bool = True
    # disaggregated demo through the shared store (README): "prefill" exports each prompt's KV and
    # records it in OUT/handoff.jsonl; "decode" takes the requests of such a record (``handoff``)
    role: str = "mixed"
    handoff: str = ""  # decode: the prefill run's handoff.jsonl
    device_ids: str = ""  # "0,1": the device of each rank (default rank r -> device r, of CUDA_VISIBLE_DEVICES)
    # FastDeploy's names (README "Settings"): the host tier in GiB or in blocks, the storage backend
    swap_space: float = 0.0
    num_cpu_blocks: int = 0
    kvcache_storage_backend: str = ""  # a URL, or "mooncake" with kvcache_storage_config / MOONCAKE_*
    kvcache_storage_config: dict[str, Any] = field(default_factory=dict)  # FastDeploy's Mooncake keys
    # KV events for KV-aware routers (fastkv.events): off without an endpoint
    kv_events_endpoint: str = ""
    kv_events_replay_endpoint: str = ""
    kv_events_topic: str = ""  # default kv@<run id>@<model id>, the topic llm-d's subscriber parses
    kv_events_buffer: int = 10_000  # batches kept for replay
    kv_events_schema: str = ""  # the consumer generation (fastkv.events.config.SCHEMAS); default llm-d
    runner_options: dict[str, Any] = field(default_factory=dict)
    scheduler: dict[str, Any] = field(default_factory=dict)
    demo: dict[str, Any] = field(default_factory=dict)  # ConversationConfig fields

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = {"int": int, "float": float, "str": str, "bool": bool}.get(str(f.type).split("[")[0], dict)
            ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) or (
                kind is float and isinstance(value, int) and not isinstance(value, bool))
            if not ok:
                raise ValueError(f"setting {f.name!r} must be of type {kind.__name__}, got {value!r}")
        self._fastdeploy_names()
        for name in ("tp", "block_size", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"setting {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ("device_blocks", "host_blocks", "storage_backlog_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"setting {name!r} must be >= 0, got {getattr(self, name)}")
        if not self.storage_lookup_timeout_s >= 0 or not self.prefetch_timeout_per_1k_tokens_s >= 0:
            raise ValueError("settings 'storage_lookup_timeout_s' and 'prefetch_timeout_per_1k_tokens_s' must be "
                             f">= 0, got {self.storage_lookup_timeout_s} and {self.prefetch_timeout_per_1k_tokens_s}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"setting 'prefetch_policy' must be one of {PREFETCH_POLICIES}, "
                             f"got {self.prefetch_policy!r}")
        if self.hit_policy not in HIT_POLICIES:
            raise ValueError(f"setting 'hit_policy' must be one of {HIT_POLICIES}, got {self.hit_policy!r}")
        if self.cache_policy not in CACHE_POLICIES:
            raise ValueError(f"setting 'cache_policy' must be one of {CACHE_POLICIES}, got {self.cache_policy!r}")
        if self.async_scheduling not in ("on", "off"):
            raise ValueError(f"setting 'async_scheduling' must be 'on' or 'off', got {self.async_scheduling!r}")
        if self.engine_cpu_policy not in CPU_POLICIES:
            raise ValueError(f"setting 'engine_cpu_policy' must be one of {CPU_POLICIES}, "
                             f"got {self.engine_cpu_policy!r}")
        if self.storage_write not in STORAGE_WRITES:
            raise ValueError(f"setting 'storage_write' must be one of {STORAGE_WRITES}, got {self.storage_write!r}")
        if self.eviction not in POLICIES:
            raise ValueError(f"setting 'eviction' must be one of {sorted(POLICIES)}, got {self.eviction!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ValueError(f"setting 'preemption' must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.runner not in RUNNERS:
            raise ValueError(f"setting 'runner' must be one of {RUNNERS}, got {self.runner!r}")
        if self.preemption == "storage" and self.storage == "none":
            raise ValueError("preemption 'storage' needs a storage tier: set 'storage' to a URL (or leave the default)")
        # Swaps and storage copies both go through the host tier (the transfer process stages there).
        if self.host_blocks == 0 and self.preemption != "recompute":
            raise ValueError(f"preemption {self.preemption!r} needs a host tier (host_blocks > 0); "
                             "without one only 'recompute' works")
        if self.host_blocks == 0 and self.storage not in ("default", "none"):
            raise ValueError("a storage tier needs a host tier (blocks are stored from and loaded into host "
                             "memory): set host_blocks > 0 or storage 'none'")
        if self.storage_write != "through" and (self.storage == "none" or (self.storage == "default"
                                                                            and self.host_blocks == 0)):
            raise ValueError(f"storage_write {self.storage_write!r} says what reaches a storage tier, and this run "
                             "has none: drop it or give 'storage'")
        if self.storage not in ("default", "none") and self.storage.split("://")[0] not in STORAGE_SCHEMES:
            raise ValueError(f"setting 'storage' must be 'default', 'none' or a URL with scheme in {STORAGE_SCHEMES}, "
                             f"got {self.storage!r}")
        if self.runner == "tiny" and self.dtype != "float32":
            raise ValueError(f"the tiny runner needs dtype 'float32', got {self.dtype!r}")
        if self.runner == "synthetic" and self.head_dim <= 8:
            raise ValueError(f"the synthetic runner needs head_dim > 8, got {self.head_dim}")
        self._check_scheduler()
        if self.runner == "synthetic" and self.runner_options.get("cost_model"):
            from fastkv.deploy.cost_model import deployment

            deployment(self.runner_options["cost_model"])  # an unknown name fails here, naming the choices
        if self.runner == "tiny":
            try:
                self.tiny_config().check(self.layout())
            except ValueError as exc:
                if isinstance(exc, TableError):
                    raise
                raise ValueError(f"the tiny runner cannot run this shape: {exc}") from None
        if self.runner.startswith("paddleformers:"):
            self._check_paddleformers()
        if not 0 <= self.metrics_port < 65536:
            raise ValueError(f"setting 'metrics_port' must be in [0, 65536), got {self.metrics_port}")
        if self.heartbeat_s <= 0 or self.dead_after_s <= self.heartbeat_s:
            raise ValueError("need heartbeat_s > 0 and dead_after_s > heartbeat_s")
        self.layout()  # dtype
        self.demo_config()  # demo table
        if not self.workload:
            raise ValueError("setting 'workload' must be 'demo', 'trace', 'trace:N' or a workload.jsonl path")
        if self.workload.startswith("trace:"):
            count = self.workload[len("trace:"):]
            if not count.isdigit() or int(count) < 1:
                raise ValueError(f"workload 'trace:N' needs a positive request count, got {self.workload!r}")
        if not self.device_blocks:
            object.__setattr__(self, "device_blocks", self._default_device_blocks())
        if self.device_ids and not all(d.strip().isdigit() for d in self.device_ids.split(",")):
            raise ValueError(f"setting 'device_ids' must be comma-separated device numbers, got {self.device_ids!r}")
        self._check_role()
        self.to_spec("check", Path(self.out))  # weights_version, update_weights_at, device_ids

    def _fastdeploy_names(self) -> None:
        """FastDeploy's settings, mapped onto fastkv's own: swap_space (GiB per rank) or
        num_cpu_blocks -> host_blocks; kvcache_storage_backend -> storage."""
        if self.swap_space < 0 or self.num_cpu_blocks < 0:
            raise ValueError("settings 'swap_space' and 'num_cpu_blocks' must be >= 0")
        if self.swap_space and self.num_cpu_blocks:
            raise ValueError("give the host tier as 'swap_space' (GiB) or as 'num_cpu_blocks', not both")
        if self.swap_space:
            block = self.layout().block_bytes
            blocks = int(self.swap_space * 2**30) // block
            if blocks < 1:
                raise ValueError(f"swap_space {self.swap_space} GiB holds no block of {block} bytes")
            object.__setattr__(self, "host_blocks", blocks)
        elif self.num_cpu_blocks:
            object.__setattr__(self, "host_blocks", self.num_cpu_blocks)
        if self.kvcache_storage_config and self.kvcache_storage_backend != "mooncake":
            raise ValueError("setting 'kvcache_storage_config' is for kvcache_storage_backend = \"mooncake\"")
        if self.kvcache_storage_backend:
            if self.storage != "default":
                raise ValueError("give the storage tier as 'storage' or as 'kvcache_storage_backend', not both")
            storage = self.kvcache_storage_backend
            if storage == "mooncake":  # FastDeploy's keys: this table > MOONCAKE_CONFIG_PATH > MOONCAKE_* env
                from fastkv.storage import mooncake_config

                storage = mooncake_config.to_url(mooncake_config.resolve(self.kvcache_storage_config))
            object.__setattr__(self, "storage", storage)

    def _check_scheduler(self) -> None:
        from fastkv.sched.config import SchedulerConfig

        known = {f.name for f in dataclasses.fields(SchedulerConfig)}
        if unknown := set(self.scheduler) - known:
            raise TableError(f"unknown scheduler settings {sorted(unknown)}; known: {sorted(known)}")

    def tiny_config(self):
        """The tiny runner's ``TinyConfig`` (runner option ``config``), without importing Paddle."""
        from fastkv.engine.runners.tiny_config import TinyConfig

        opts = self.runner_options.get("config", {})
        known = {f.name for f in dataclasses.fields(TinyConfig)}
        if not isinstance(opts, dict):
            raise TableError(f"runner_options.config must be a table of {sorted(known)}, got {opts!r}")
        if unknown := set(opts) - known:
            raise TableError(f"unknown runner_options.config settings {sorted(unknown)}; known: {sorted(known)}")
        return TinyConfig(**opts)

    def _check_paddleformers(self) -> None:
        """The model settings against the layout, and the library's presence, without importing it."""
        import importlib.util

        from fastkv.engine.runners.paddleformers_config import OPTIONS, settings

        if unknown := set(self.runner_options) - set(OPTIONS):
            raise TableError(f"unknown runner_options {sorted(unknown)} for the {self.runner} runner; "
                             f"known: {sorted(OPTIONS)}")
        try:
            settings(self.runner.removeprefix("paddleformers:"), self.layout(), self.runner_options)
        except ValueError as exc:
            raise ValueError(f"the {self.runner} runner cannot run this shape: {exc}") from None
        if importlib.util.find_spec("paddleformers") is None:
            raise ValueError(f"the {self.runner} runner needs PaddleFormers: pip install -e '.[cpu,models]'")

    def check_runner_options(self) -> None:
        """TableError for a runner option the reference runner does not take. Only for the
        default worker: a worker given by --entry reads the options its own way."""
        if self.runner == "synthetic":
            from fastkv.engine.runners.synthetic import SyntheticRunner

            params = inspect.signature(SyntheticRunner).parameters.values()
            known = {p.name for p in params if p.kind is p.KEYWORD_ONLY}
        elif self.runner.startswith("paddleformers:"):
            from fastkv.engine.runners.paddleformers_config import OPTIONS

            known = set(OPTIONS)
        else:
            known = {"config"}  # the worker passes the collective itself
        if unknown := set(self.runner_options) - known:
            raise TableError(f"unknown runner_options {sorted(unknown)} for the {self.runner} runner; "
                             f"known: {sorted(known)}")

    def _default_device_blocks(self) -> int:
        """The demo's device tier is small on purpose. The trace's prompts, and a workload
        file's (say, a trace run's own workload.jsonl run again on its store), may reach
        thousands of tokens: their tier holds at least the longest request (prompt and output),
        so every request runs to its end and the pressure comes from requests running side by
        side, rather than from requests that could never run; and a step's token budget more,
        so that one long prompt leaves room for short ones beside it. Up to ``AUTO_DEVICE_BYTES`` per
        rank: a longer request is rejected alone (its reason names the tier it exceeds), and
        ``--device-blocks`` gives it room."""
        if self.workload == "demo":
            return DEMO_DEVICE_BLOCKS
        longest = max(len(r["prompt"]) + r["max_new_tokens"] for r in self.requests())
        cap = max(DEMO_DEVICE_BLOCKS, AUTO_DEVICE_BYTES // self.layout().block_bytes)
        beside = self.scheduler.get("max_num_batched_tokens", SchedulerConfig().max_num_batched_tokens)
        return min(cap, max(DEMO_DEVICE_BLOCKS, -(-longest // self.block_size) + -(-beside // self.block_size)))

    def _is_trace(self) -> bool:
        return self.workload == "trace" or self.workload.startswith("trace:")

    def vocab(self) -> int:
        """The runner's vocab: every token id of the workload must be below it."""
        if self.runner.startswith("paddleformers:"):
            from fastkv.engine.runners.paddleformers_config import vocab_size

            return vocab_size(self.runner_options) or RUNNER_VOCAB
        opts = self.runner_options.get("config", {}) if self.runner == "tiny" else self.runner_options
        return opts.get("vocab", RUNNER_VOCAB) if isinstance(opts, dict) else RUNNER_VOCAB

    @classmethod
    def from_sources(cls, path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> JobConfig:
        """Defaults, then the config file at ``path``, then ``overrides`` (flags that were given):
        flag > config file > default (``fastkv.cli.precedence``). ``overridden`` lists each value a
        flag overrode in the file."""
        from fastkv.cli.precedence import Layer, flag_name, merge

        layers = [Layer(f"config file {path}", read_config_file(path), str)] if path is not None else []
        layers.append(Layer("flags", dict(overrides or {}), flag_name))
        values, notes = merge(layers)
        with in_file(path):
            cfg = cls(**values)
        object.__setattr__(cfg, "overridden", notes)
        return cfg

    def layout(self) -> KVLayout:
        return KVLayout(num_layers=self.layers, kv_heads=self.kv_heads, block_size=self.block_size,
                        head_dim=self.head_dim, dtype=self.dtype, tp_size=self.tp)

    def demo_config(self) -> ConversationConfig:
        known = {f.name for f in dataclasses.fields(ConversationConfig)}
        unknown = set(self.demo) - known
        if unknown:
            raise ValueError(f"unknown demo settings {sorted(unknown)}; known: {sorted(known)}")
        values = {**(QUICK_DEMO if self.quick else {}), "seed": self.seed, **self.demo}
        if isinstance(values.get("user_tokens"), list):
            values["user_tokens"] = tuple(values["user_tokens"])
        return ConversationConfig(**values)

    def storage_url(self, out_dir: Path) -> str:
        if self.storage == "none" or self.host_blocks == 0:  # "default" without a host tier: no storage tier
            return ""
        if self.storage == "default":
            return f"lmdb://{out_dir / 'store'}?max_bytes=1G"
        return self.storage

    def requests(self) -> list[dict[str, Any]]:
        from fastkv import workload

        if self.workload != "demo" and not self._is_trace():
            return workload.read_workload(self.workload, self.vocab())
        if self.workload == "demo":
            requests = workload.conversations(self.demo_config())
        else:
            n = int(self.workload[6:]) if ":" in self.workload else (16 if self.quick else 48)
            requests = workload.trace(n, seed=self.seed, vocab=self.demo_config().vocab)
        for req in requests:  # the demo's vocab setting may exceed the runner's
            workload.check_request(req, self.vocab())
        return requests

    def full_runner_options(self) -> dict[str, Any]:
        """The runner's defaults under the job's options; a cost model replaces the default
        flat cost per token."""
        defaults = dict(DEFAULT_RUNNER_OPTIONS[self.runner])
        if self.runner_options.get("cost_model"):
            defaults.pop("compute_us_per_token", None)
        return {**defaults, **self.runner_options}

    def _check_role(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"setting 'role' must be one of {ROLES}, got {self.role!r}")
        if self.role == "mixed":
            if self.handoff:
                raise ValueError("setting 'handoff' is for --role decode")
            return
        if self.storage in ("default", "none") or not self.enable_prefix_caching:
            raise ValueError(f"--role {self.role} hands KV over through a shared store: give --storage "
                             "lmdb://DIR or redis://HOST:PORT (the same for both roles), with prefix caching on")
        if self.role == "decode" and (not self.handoff or Path(self.handoff).is_dir()):
            raise ValueError("--role decode needs --handoff FILE, the prefill run's OUT/handoff.jsonl (it may not "
                             f"exist yet: the decode run follows it as it is written); got {self.handoff!r}")
        if self.role == "decode":
            _check_handoff_file(Path(self.handoff))

    def to_spec(self, run_id: str, out_dir: Path):
        from fastkv.run import RunSpec

        return RunSpec(
            run_id=run_id, layout=self.layout(), num_device_blocks=self.device_blocks,
            num_host_blocks=self.host_blocks, storage_url=self.storage_url(out_dir), runner=self.runner,
            runner_options=self.full_runner_options(),
            cache_policy=self.cache_policy, storage_writes=self.storage_write, eviction=self.eviction,
            host_checksums=self.host_checksums, async_scheduling=self.async_scheduling == "on",
            engine_cpu_policy=self.engine_cpu_policy,
            scheduler=dict(self.scheduler),
            heartbeat_s=self.heartbeat_s,
            dead_after_s=self.dead_after_s,
            task_timeout_s=self.task_timeout_s, storage_lookup_timeout_s=self.storage_lookup_timeout_s,
            storage_backlog_blocks=self.storage_backlog_blocks, prefetch_policy=self.prefetch_policy,
            prefetch_timeout_per_1k_tokens_s=self.prefetch_timeout_per_1k_tokens_s, hit_policy=self.hit_policy,
            out_dir=str(out_dir), metrics_port=self.metrics_port, metrics_linger_s=self.metrics_linger_s,
            weights_version=self.weights_version,
            update_weights_at=tuple(u.strip() for u in self.update_weights_at.split(",") if u.strip()),
            free_memory_on_update=self.free_memory_on_update, enable_prefix_caching=self.enable_prefix_caching,
            role=self.role, handoff=str(Path(self.handoff).resolve()) if self.handoff else "",
            device_ids=tuple(int(d) for d in self.device_ids.split(",") if d.strip()),
            kv_events=self.kv_events(),
        )

    def kv_events(self) -> dict[str, Any]:
        if not (self.kv_events_endpoint or self.kv_events_replay_endpoint):
            return {}
        out: dict[str, Any] = {"endpoint": self.kv_events_endpoint, "replay_endpoint": self.kv_events_replay_endpoint,
                               "buffer_steps": self.kv_events_buffer}
        if self.kv_events_topic:
            out["topic"] = self.kv_events_topic
        if self.kv_events_schema:
            out["schema"] = self.kv_events_schema
        return out


class TableError(ValueError):
    """A bad key in a nested table (``scheduler``, ``runner_options``): only a config file sets them."""


@contextlib.contextmanager
def in_file(path: str | Path | None) -> Iterator[None]:
    """A TableError names the config file the table came from."""
    try:
        yield
    except TableError as exc:
        if path is None:
            raise
        raise ValueError(f"config file {path}: {exc}") from None


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} not found")
    try:
        doc = json.loads(path.read_text()) if path.suffix == ".json" else tomllib.loads(path.read_text())
    except (ValueError, tomllib.TOMLDecodeError) as exc:
        raise ValueError(f"config file {path}: {exc}") from None
    if not isinstance(doc, dict):
        raise ValueError(f"config file {path} must hold a table/object of settings")
    known = {f.name for f in dataclasses.fields(JobConfig)}
    unknown = set(doc) - known
    if unknown:
        raise ValueError(f"config file {path}: unknown settings {sorted(unknown)}; known: {sorted(known)}")
    return doc


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="fastkv-supervisor", description=__doc__.split("\n\n")[0],
        allow_abbrev=False,  # a typo such as --storag is an error, never silently another flag
        epilog="Precedence: flag > config file > default, whichever of a setting's names each uses "
        "(--host-blocks / --swap-space / --num-cpu-blocks; --storage / --kvcache-storage-backend); one layer "
        "giving two names of one setting is an error, and the banner says which value a flag overrode. "
        "Writes <out>/summary.json, results.jsonl, report.json, report.png and logs/.")
    a = p.add_argument
    a("--config", metavar="FILE", help="TOML or JSON file of settings (flags override it)")
    a("--tp", type=int, help="tensor-parallel size (default 1)")
    a("--block-size", type=int, help="tokens per KV block (default 16)")
    a("--layers", type=int, help="model layers (default 4)")
    a("--kv-heads", type=int, help="KV heads per rank (default 2)")
    a("--head-dim", type=int, help="head dimension (default 64)")
    a("--dtype", help="KV dtype (default float32)")
    a("--device-blocks", type=int, help=f"device tier capacity in blocks per rank (default {DEMO_DEVICE_BLOCKS}; "
      "a trace or a workload file defaults to room for its longest request, up to 1 GiB per rank)")
    a("--host-blocks", type=int, help="host tier capacity in blocks per rank, 0 = none (default 1024); under "
      "write-through, running requests hold their host copies: give it more blocks than the device tier")
    a("--storage", help="storage URL (lmdb://DIR, redis://HOST:PORT, mooncake://MASTER:PORT?..., mooncake://local "
      "= a Mooncake pool of this run's own), 'none', or 'default' = lmdb://<out>/store")
    a("--preemption", choices=PREEMPTION_MODES, help="what preempting a request does (default offload)")
    a("--cache-policy", choices=CACHE_POLICIES, help="when blocks are copied to the host tier (default write_through)")
    a("--storage-write", choices=STORAGE_WRITES,
      help="which blocks are written to the storage tier: 'through' every block once it is on the host "
      "(the most writes; restarts and other engines hit everything), 'preempted' only preempted requests' "
      "(the fewest), 'back' host blocks about to be evicted (one write per host eviction) (default through)")
    a("--storage-backlog-blocks", type=int, metavar="N", help="STOREs in flight past which the write policy's "
      "optional ones are skipped and counted, so a slow storage tier falls behind instead of stalling steps "
      "(default 256; a preempted request's are always stored)")
    a("--hit-policy", choices=HIT_POLICIES, help="which host and storage hits admission loads: auto (default: "
      "those whose copy, behind the copies queued on its link, ends before recomputing them would, under the "
      "runner's cost model; all without one), load (every hit) or recompute (none); outputs are the same")
    a("--prefetch-policy", choices=PREFETCH_POLICIES, help="how long a new request waits for its storage lookup: "
      "timeout (default: --storage-lookup-timeout-s plus --prefetch-timeout-per-1k-tokens-s per 1,000 prompt "
      "tokens), best_effort (not at all) or wait_complete (until it is answered)")
    a("--storage-lookup-timeout-s", type=float, metavar="S", help="the timeout prefetch policy's base wait "
      "(default 0.2)")
    a("--prefetch-timeout-per-1k-tokens-s", type=float, metavar="S", help="the timeout prefetch policy's wait "
      "per 1,000 prompt tokens, on top of the base (default 0)")
    a("--async-scheduling", choices=("on", "off"), help="on (default): the engine plans and sends each step "
      "while the workers run the one before; off: one step at a time (outputs are the same)")
    a("--engine-cpu-policy", choices=CPU_POLICIES, help="the engine thread's Linux scheduling policy: batch "
      "(default: a worker's output wakes the engine without the engine preempting that worker) or normal")
    a("--eviction", choices=sorted(POLICIES), help="the order cached blocks leave a tier (default lru)")
    a("--runner", choices=RUNNERS, help="reference model runner (default synthetic)")
    a("--workload", help="demo | trace | trace:N | path to a workload.jsonl (default demo)")
    a("--seed", type=int, help="workload seed (default 0)")
    a("--out", help="output directory (default ./fastkv-out)")
    a("--metrics-port", type=int, help="engine Prometheus port, 0 = off (default 0); checked free before the run")
    a("--metrics-linger-s", type=float, metavar="S", help="with --metrics-port: keep the endpoint up S seconds "
      "after the run for a final scrape (default 3); OUT/metrics.prom holds the final values either way")
    a("--quick", action="store_true", default=None, help="a smaller demo workload")
    a("--weights-version", help="weights the run starts with, any string (default 0)")
    a("--update-weights-at", action="append", metavar="N:VERSION",
      help="switch to the weights VERSION once N requests have finished (repeatable)")
    a("--free-memory-on-update", action="store_true", default=None,
      help="release the device and host tiers' memory during each weight update")
    a("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
      help="reuse KV across requests that share a prefix (default on)")
    a("--role", choices=ROLES, help="mixed (default); prefill: compute each prompt, export its KV to the shared "
      "store and record it in OUT/handoff.jsonl; decode: take the requests of --handoff from that store")
    a("--handoff", metavar="FILE", help="--role decode: the prefill run's OUT/handoff.jsonl, followed as it is "
      "written (start both runs together, or decode after prefill)")
    a("--device-ids", metavar="D0,D1,..", help="device of each rank (default: rank r uses device r)")
    a("--swap-space", type=float, metavar="GIB", help="FastDeploy's name: host tier in GiB per rank")
    a("--num-cpu-blocks", type=int, help="FastDeploy's name: host tier in blocks per rank")
    a("--kvcache-storage-backend", metavar="URL", help="FastDeploy's name: the storage tier (as --storage)")
    a("--kv-events-endpoint", metavar="URL", help="publish KV events for routers on this ZMQ PUB address "
      "(tcp://*:5557 binds, tcp://HOST:PORT connects; default off)")
    a("--kv-events-replay-endpoint", metavar="URL", help="ZMQ ROUTER address that replays missed KV event batches")
    a("--kv-events-topic", help="KV events topic (default kv@<run id>@<model id>)")
    a("--kv-events-buffer", type=int, metavar="N", help="KV event batches kept for replay (default 10000)")
    a("--kv-events-schema", choices=EVENT_SCHEMAS, help="KV event wire form, by consumer: llm-d (default; llm-d's "
      "released indexer, vLLM before lora_name), vllm-array (vLLM with lora_name, array events), vllm (vLLM main: "
      "tagged-map events); docs/KV_EVENTS.md")
    a("--run-id", help="name of the run's shared-memory namespace (default: random)")
    a("--entry", action="append", default=[], metavar="ROLE=MODULE:FUNC",
      help="replace a process's entry point (roles: engine, worker, transfer), e.g. your own worker")
    a("--no-progress", action="store_true", help="no progress bar")
    a("--cleanup", action="store_true",
      help="remove the shared memory of crashed runs (all dead runs, or only --run-id) and exit")
    return p


def _flags(args: argparse.Namespace) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(JobConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    if flags.get("update_weights_at"):
        flags["update_weights_at"] = ",".join(flags["update_weights_at"])
    return flags


def at_least(minimum: float, kind: type = int):
    """An argparse ``type``: a number of ``kind`` >= ``minimum``, else the usage error naming the
    flag (scripts/bench_*.py: a count of 0 or -1 read as "the default" or crashed later)."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"invalid {kind.__name__} value: {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be >= {minimum}, got {text}")
        return value
    return parse


def parse_entries(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        role, sep, target = item.partition("=")
        if not sep or role not in ("engine", "worker", "transfer") or ":" not in target:
            raise ValueError(f"--entry must be ROLE=MODULE:FUNC with ROLE engine, worker or transfer; got {item!r}")
        out[role] = target
    return out


def cleanup(run_id: str | None) -> int:
    from fastkv.ipc import cleanup as cleanup_run
    from fastkv.ipc import cleanup_stale

    removed = cleanup_run(run_id) if run_id else cleanup_stale()
    print(f"fastkv-supervisor: removed {len(removed)} shared-memory objects" + (f" of run {run_id}" if run_id else ""))
    for name in removed:
        print(f"  {name}")
    return 0


def prepare(cfg: JobConfig, run_id: str | None = None, outdir: OutDir | None = None):
    """Output directory, workload.jsonl and spec.json of a job; returns (spec, workload path).
    ``outdir``: ``cfg.out`` as claimed by the caller for run ``outdir.run_id``, held for the
    run; without one it is claimed for the preparation only (tests, benchmarks), for run
    ``run_id`` (default: a fresh id)."""
    from fastkv.workload import write_workload

    if outdir is None:
        with OutDir.claim(cfg.out, run_id or secrets.token_hex(4)) as held:
            return prepare(cfg, outdir=held)
    outdir.clear_previous()
    if cfg.storage == "default" and cfg.storage_url(outdir.path):
        outdir.fresh_store()  # runs start empty, so they are comparable
    workload = write_workload(cfg.requests(), outdir.path / "workload.jsonl", cfg.preemption)
    spec = cfg.to_spec(outdir.run_id, outdir.path)
    spec.save(outdir.path / "spec.json")
    return spec, workload


class _Progress:
    def __init__(self, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=None, unit="req", desc="fastkv", disable=not enabled, dynamic_ncols=True)

    def __call__(self, finished: int, total: int) -> None:
        if (total or None) != self.bar.total or finished != self.bar.n:
            self.bar.total = total or None
            self.bar.n = finished
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


_caught: int | None = None  # the start-up's stop signal, also when what it raised was swallowed


def _interrupted(signum: int, _frame: Any) -> None:
    # Raising from a handler is how a long start-up step (a pool starting, a probe) is cut short,
    # but whatever runs at that moment may swallow it (a __del__, a library's bare except): the
    # signal is recorded first, and the hand-over to the supervisor honours it.
    global _caught
    _caught = _caught or signum
    raise _Interrupted(signum)


def _hand_over(sup: Any) -> None:
    """From here a stop signal asks ``sup`` to stop (what its own handlers do once it runs), and
    one that came during the start-up and was lost on the way stops it before anything starts."""
    def stop(signum: int, _frame: Any) -> None:
        sup.request_stop(f"interrupted by {signal.Signals(signum).name}")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    if _caught is not None:
        sup.request_stop(f"interrupted by {signal.Signals(_caught).name}")


def _config_error(parser: argparse.ArgumentParser, exc: Exception) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {exc}\n")  # one line: the usage is no help here


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cleanup:
            return cleanup(args.run_id)
        roles = parse_entries(args.entry)
        cfg = JobConfig.from_sources(args.config, _flags(args))
        if "worker" not in roles:
            with in_file(args.config):
                cfg.check_runner_options()
        # All before anything is written: a live run's directory or namespace is not ours, and
        # a busy port would only fail the engine once everything had started.
        from fastkv.engine.metrics import check_port

        check_port(cfg.metrics_port)
        if cfg.kv_events():
            from fastkv.events.config import EventsConfig

            EventsConfig(**cfg.kv_events()).check_endpoints()
        run_id = _new_run_id(args.run_id)
        outdir = OutDir.claim(cfg.out, run_id)
    except (ValueError, NotBuilt) as exc:
        _config_error(parser, exc)
    with outdir:  # held until the run is over: a second run on this --out is refused
        return _prepare_and_run(parser, args, cfg, roles, outdir)


def _new_run_id(requested: str | None) -> str:
    from fastkv.ipc import Namespace, list_runs

    if requested is None:
        return secrets.token_hex(4)
    Namespace.attach(requested)  # checks the name
    for run in list_runs():
        if run.run_id == requested and run.alive:
            raise ValueError(f"--run-id {requested} is in use by a live run (pid {run.owner_pid})")
    return requested


def _prepare_and_run(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: JobConfig,
                     entries: dict[str, str], outdir: OutDir) -> int:
    from fastkv.engine.engine import write_missing
    from fastkv.transfer.tiers import _cuda_available

    # Importing Paddle replaces the C-level SIGTERM handler with one that exits at once (in any
    # thread); so first Paddle, while nothing of the run exists, then our handlers. Until the
    # supervisor's own go in, a signal unwinds the start-up and the run ends as stopped.
    global _caught
    _cuda_available()
    _caught = None
    old_handlers = {signum: signal.signal(signum, _interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    pool = None  # mooncake://local: the run's own Mooncake pool
    try:
        # held back by fastkv.__main__ until now (a no-op otherwise); one that came meanwhile lands here
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            spec, workload = prepare(cfg, outdir=outdir)
            pool = _local_pool(spec.storage_url)
            if pool is not None:
                spec = dataclasses.replace(spec, storage_url=pool.url)
            if spec.storage_url:  # a tier that cannot open would only be logged by the transfer processes
                from fastkv.storage import probe_store

                probe_store(spec.storage_url, spec.tp_size)
        except ValueError as exc:
            _config_error(parser, exc)
        # frames of a progress bar only to a terminal: a log file would keep every one
        return _run(cfg, spec, workload, entries, not args.no_progress and sys.stderr.isatty())
    except _Interrupted as exc:
        # prepare() may have written the workload (atomically) and not returned yet: the file,
        # once the previous run's are gone, says whether this run owes a summary
        wrote = outdir.cleared and (outdir.path / "workload.jsonl").is_file()
        if wrote:
            write_missing(outdir.path, outdir.path / "workload.jsonl", "stopped")
        print(f"fastkv-supervisor: stopped by {exc.signal.name} before the run started"
              + (f"; every request is listed unfinished in {outdir.path / 'results.jsonl'}" if wrote else ""),
              file=sys.stderr)
        return 128 + exc.signal
    finally:
        if pool is not None:
            pool.stop()
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)


def _local_pool(url: str):
    """``mooncake://local[?segment_size=4G]``: a Mooncake master and holder on 127.0.0.1 for
    this run, started (and stopped) by the supervisor; None for any other URL."""
    if not url.startswith("mooncake://local"):
        return None
    from fastkv.storage.local_mooncake import LocalMooncake

    pool = LocalMooncake.from_url(url)
    try:
        pool.start()
    except (OSError, RuntimeError) as exc:
        why = str(exc).splitlines()[0]
        raise ValueError(f"--storage {url}: the local Mooncake pool did not start: {why}") from None
    return pool


def _run(cfg: JobConfig, spec, workload: Path, entries: dict[str, str], progress_bar: bool) -> int:
    from fastkv.cli import report
    from fastkv.cli.supervisor import Supervisor
    from fastkv.procs.proctitle import set_title

    set_title("supervisor", None, spec.run_id)
    print(f"fastkv-supervisor: run {spec.run_id}: {spec.tp_size} rank(s), {cfg.runner} runner, "
          f"preemption {cfg.preemption}, {spec.num_device_blocks} device / {spec.num_host_blocks} host blocks, "
          f"storage {spec.storage_url or 'none'}; output in {spec.out_dir}", file=sys.stderr)
    for note in getattr(cfg, "overridden", []):
        print(f"fastkv-supervisor: {note}", file=sys.stderr)
    progress = _Progress(progress_bar)
    try:
        sup = Supervisor(spec, workload, entry_points=entries, progress=progress)
        _hand_over(sup)
        result = sup.run()
    finally:
        progress.close()
    code = 0 if result.ok else 130 if "SIGINT" in result.message else 143 if "SIGTERM" in result.message else 1
    stopped_by = result.message.removeprefix("interrupted by ") if result.message.startswith("interrupted by ") else ""
    out = Path(spec.out_dir)
    if not result.ok and not (stopped_by and (out / "summary.json").is_file()):
        print(f"fastkv-supervisor: run failed: {result.message}", file=sys.stderr)
        return code
    if stopped_by == "SIGTERM":  # an orchestrator's stop: no time spent drawing a report
        done = json.loads((out / "summary.json").read_text())
        print(f"fastkv-supervisor: stopped by SIGTERM after {done['requests']} of {sum(done['states'].values())} "
              f"requests; summary: {out / 'summary.json'}, results: {out / 'results.jsonl'}, logs: {out / 'logs'}",
              file=sys.stderr)
        return code
    # a stopped run's report covers the requests that finished
    rep = report.write(spec.out_dir, title=report.title(cfg.role, cfg.workload, cfg.preemption))
    print(rep.table)
    if faults := report.storage_faults(rep.data):  # the run degraded to recompute: say so, not only in a log
        print(f"fastkv-supervisor: warning: storage tier {spec.storage_url} failed during the run: {faults} "
              f"(see {spec.out_dir}/logs)", file=sys.stderr)
    if behind := report.storage_behind(rep.data):  # the pool silently misses what the run computed
        print(f"fastkv-supervisor: warning: storage tier {spec.storage_url} fell behind: {behind} "
              f"(--storage-backlog-blocks {spec.storage_backlog_blocks})", file=sys.stderr)
    print(f"report:  {rep.json_path}\nplot:    {rep.png_path}\nresults: {out / 'results.jsonl'}\n"
          f"logs:    {out / 'logs'}")
    if stopped_by:
        done, total = rep.data["requests"], sum(rep.data.get("states", {}).values())
        print(f"fastkv-supervisor: stopped by {stopped_by} after {done} of {total} requests", file=sys.stderr)
    return code


def _check_handoff_file(path: Path) -> None:
    """A handoff file that is already there must start as a prefill run writes it (a header
    line); one that is not there yet is followed once it appears."""
    try:
        with path.open("rb") as f:
            first = f.readline()
    except FileNotFoundError:
        return
    except OSError as exc:
        raise ValueError(f"--handoff {path}: cannot read it ({exc.strerror})") from None
    if not first.endswith(b"\n"):
        return  # empty, or its header is being written
    try:
        doc = json.loads(first)
    except ValueError:
        doc = None
    if not isinstance(doc, dict) or "header" not in doc:
        raise ValueError(f"--handoff {path}:1: not a prefill run's handoff.jsonl (its first line is no header)")


if __name__ == "__main__":
    sys.exit(main())

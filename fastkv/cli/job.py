"""A ``fastkv-supervisor`` job: its settings (``JobConfig``), merged flag > config file >
default whichever of a setting's names each layer uses (``swap_space`` / ``num_cpu_blocks`` /
``host_blocks``; ``kvcache_storage_backend`` / ``storage``), and checked up front, naming the
setting; the config file's reading (TOML or JSON, tables ``runner_options``, ``scheduler``,
``demo``)."""
from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import re
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastkv.cache.eviction import POLICIES
from fastkv.config import KV_CACHE_DTYPES, KV_LAYOUTS, QUANT_DTYPES, KVLayout
from fastkv.procs.cpu_policy import CPU_POLICIES
from fastkv.sched.config import SchedulerConfig
from fastkv.sched.hits import HIT_POLICIES
from fastkv.sched.prefetch import PREFETCH_POLICIES
from fastkv.workload import PREEMPTION_MODES, ConversationConfig

_SETTING = re.compile(r"setting '(\w+)'")  # how JobConfig's checks name a setting

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
# FastDeploy's kv_cache_quant_type values that fastkv supports, as kv_cache_dtype
FASTDEPLOY_QUANT_TYPES = {"int8": "int8", "fp8": "fp8_e4m3", "fp8_e4m3": "fp8_e4m3"}
QUICK_DEMO = {"conversations": 8, "turns": 3}
DEMO_DEVICE_BLOCKS = 64  # the demo's conversations need several times this: memory pressure
AUTO_DEVICE_BYTES = 1 << 30  # the most device tier per rank a workload's longest request sizes by default
RUNNER_VOCAB = 1024  # both reference runners' default vocab (runner option "vocab", tiny: config.vocab)
DEFAULT_HOST_BLOCKS = 1024
KV_CACHE_GROUPS = ("auto", "on", "off")


@dataclass(frozen=True)
class JobConfig:
    """One supervisor job. Capacities are in blocks of ``block_size`` tokens, per rank."""

    tp: int = 1
    block_size: int = 16
    layers: int = 4
    kv_heads: int = 2  # per rank
    head_dim: int = 64
    dtype: str = "float32"
    # vLLM's name, KV_CACHE_DTYPES: "auto" keeps ``dtype``; fp8_e4m3 / int8 quantize the KV with a
    # float32 scale per token-head (fastkv.config); FastDeploy's name is kv_cache_quant_type
    kv_cache_dtype: str = "auto"
    kv_cache_quant_type: str = ""
    # KV_LAYOUTS: "kv" a K and a V per layer; "mla" one latent of head_dim values per token and
    # layer, whole on every rank (kv_heads 1; the tiny runner's MLA mode)
    kv_layout: str = "kv"
    # 0: the workload's default: DEMO_DEVICE_BLOCKS, or room for the longest request of a trace or a file
    # (a sliding-window hybrid: the bytes of this many blocks of every layer, split between its KV
    # cache groups in the proportion the workload's requests need them)
    device_blocks: int = 0
    # 0 = no host tier; None: DEFAULT_HOST_BLOCKS, or with KV cache groups on none unless preemption offloads
    host_blocks: int | None = None
    # "default": lmdb://<out>/store, fresh every run (none without a host tier or with KV cache groups on);
    # "none": no storage tier
    storage: str = "default"
    preemption: str = ""  # "": offload, or recompute when KV cache groups are on
    # host tier: write_through copies full blocks as they fill, so evicting them never waits for a
    # copy (write_back makes the request that evicts wait for the block's copy to the host)
    cache_policy: str = "write_through"
    # which blocks reach the storage tier: "through" (every block once on the host) makes the pool
    # useful to restarts and other engines; "preempted" and "back" write less
    storage_write: str = "through"
    eviction: str = "lru"  # the order cached blocks leave a tier: lru | lfu
    host_checksums: bool = True  # checksum host blocks (a corrupt one is recomputed, never served)
    async_scheduling: str = "on"  # "on": the engine sends step N+1 while the workers run step N; "off"
    layerwise_load: str = "on"  # "on": a step's layer l waits only for layer l of the swap-ins it needs; "off"
    # "batch": the engine's wake-ups never preempt the worker that woke it (SCHED_BATCH); "normal"
    engine_cpu_policy: str = "batch"
    runner: str = "synthetic"
    # KV cache groups for a model with sliding-window layers (docs/DESIGN.md): "on" caches a sliding
    # layer's window only, one group per window; "off" every layer in full; "auto" on unless the run
    # asks for what groups do not run with yet (storage, --role prefill/decode, weight updates,
    # array-form KV events), then off with the reason in the banner (a host tier and offload run with them)
    kv_cache_groups: str = "auto"
    # the synthetic runner's attention window per layer, repeated over the layers ("128,0": sliding
    # 128, full, sliding 128, ...; 0 = full); a PaddleFormers model's come from its config
    layer_windows: str = ""
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
            optional = str(f.type).endswith(" | None")  # None: a default decided with the others
            kind = {"int": int, "float": float, "str": str, "bool": bool}.get(
                str(f.type).removesuffix(" | None").split("[")[0], dict)
            ok = (isinstance(value, kind) and not (kind is int and isinstance(value, bool))) or (
                kind is float and isinstance(value, int) and not isinstance(value, bool)) or (
                optional and value is None)
            if not ok:
                raise ValueError(f"setting {f.name!r} must be of type {kind.__name__}, got {value!r}")
        self._fastdeploy_names()
        self._kv_cache_groups()
        for name in ("tp", "block_size", "layers", "kv_heads", "head_dim"):
            if getattr(self, name) < 1:
                raise ValueError(f"setting {name!r} must be >= 1, got {getattr(self, name)}")
        for name in ("device_blocks", "host_blocks", "storage_backlog_blocks"):
            if getattr(self, name) < 0:
                raise ValueError(f"setting {name!r} must be >= 0, got {getattr(self, name)}")
        if not self.storage_lookup_timeout_s >= 0 or not self.prefetch_timeout_per_1k_tokens_s >= 0:
            raise ValueError("settings 'storage_lookup_timeout_s' and 'prefetch_timeout_per_1k_tokens_s' must be "
                             f">= 0, got {self.storage_lookup_timeout_s} and {self.prefetch_timeout_per_1k_tokens_s}")
        for name, choices in (("prefetch_policy", PREFETCH_POLICIES), ("hit_policy", HIT_POLICIES),
                              ("cache_policy", CACHE_POLICIES), ("async_scheduling", ("on", "off")),
                              ("layerwise_load", ("on", "off")),
                              ("engine_cpu_policy", CPU_POLICIES), ("storage_write", STORAGE_WRITES),
                              ("eviction", sorted(POLICIES)), ("preemption", PREEMPTION_MODES), ("runner", RUNNERS),
                              ("kv_layout", KV_LAYOUTS)):
            if getattr(self, name) not in choices:
                raise ValueError(f"setting {name!r} must be one of {choices}, got {getattr(self, name)!r}")
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
        if self.kv_layout == "mla" and self.kv_heads != 1:
            raise ValueError(f"setting 'kv_layout' 'mla' caches one latent per token: set 'kv_heads' to 1, "
                             f"got {self.kv_heads}")
        if self.kv_layout == "mla" and self.runner != "tiny":
            raise ValueError(f"setting 'kv_layout' 'mla' needs runner 'tiny' (the runner with MLA attention), "
                             f"got {self.runner!r}")
        if self.kv_layout == "mla" and self.kv_cache_dtype in QUANT_DTYPES:
            raise ValueError(f"setting 'kv_layout' 'mla' takes no quantized KV, got 'kv_cache_dtype' "
                             f"{self.kv_cache_dtype!r}")
        if self.runner == "tiny" and self.layout().kv_cache_dtype not in ("float32", *QUANT_DTYPES):
            raise ValueError(f"the tiny runner needs KV dtype 'float32' or one of {QUANT_DTYPES}, "
                             f"got {self.layout().kv_cache_dtype!r}")
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
        object.__setattr__(self, "group_blocks", self._group_blocks())
        if self.device_ids and not all(d.strip().isdigit() for d in self.device_ids.split(",")):
            raise ValueError(f"setting 'device_ids' must be comma-separated device numbers, got {self.device_ids!r}")
        self._check_role()
        self.to_spec("check", Path(self.out))  # weights_version, update_weights_at, device_ids

    def _fastdeploy_names(self) -> None:
        """FastDeploy's settings, mapped onto fastkv's own: swap_space (GiB per rank) or
        num_cpu_blocks -> host_blocks; kvcache_storage_backend -> storage; kv_cache_quant_type ->
        kv_cache_dtype."""
        self._kv_cache_dtype()
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

    def _kv_cache_groups(self) -> None:
        """Decide the layout's windows (``windows``: the model's, when KV cache groups are on, else
        ``()``) and the defaults that follow: with groups on, recompute preemption and no host tier
        (a host tier serves a hybrid's offload only), unless preemption offloads. ``groups_note``:
        the banner's line when a model with sliding layers caches every layer in full."""
        if self.kv_cache_groups not in KV_CACHE_GROUPS:
            raise ValueError(f"setting 'kv_cache_groups' must be one of {KV_CACHE_GROUPS}, "
                             f"got {self.kv_cache_groups!r}")
        windows = self._model_windows()
        asked = self._unsupported_by_groups() if windows else []
        on = bool(windows) and (self.kv_cache_groups == "on" or (self.kv_cache_groups == "auto" and not asked))
        if self.kv_cache_groups == "on" and not windows:
            how = " (give --layer-windows, or layer_windows in the config file)" if self.runner == "synthetic" else ""
            raise ValueError(f"setting 'kv_cache_groups' 'on' needs sliding-window layers, and the {self.runner} "
                             f"runner's model has none{how}")
        if on and asked:
            raise ValueError(f"{asked[0]}: not supported with KV cache groups yet; --kv-cache-groups off runs it "
                             "with every layer cached in full")
        note = ""
        if windows and not on:
            note = ("KV cache groups off (--kv-cache-groups off): every layer cached in full" if not asked else
                    f"KV cache groups off: {', '.join(asked)} not supported with them yet, so every layer is "
                    "cached in full (--kv-cache-groups on refuses instead)")
        object.__setattr__(self, "windows", windows if on else ())
        object.__setattr__(self, "groups_note", note)
        if self.host_blocks is None:
            offloads = self.preemption in ("offload", "auto")
            object.__setattr__(self, "host_blocks", DEFAULT_HOST_BLOCKS if not on or offloads else 0)
        if not self.preemption:
            object.__setattr__(self, "preemption", "recompute" if on else "offload")

    def _model_windows(self) -> tuple[int, ...]:
        """Per layer the model's attention window (0 full), () when none slides: the synthetic
        runner's ``layer_windows``, a PaddleFormers model's config (``layer_types``, ``sliding_window``)."""
        if self.layer_windows and self.runner != "synthetic":
            raise ValueError(f"setting 'layer_windows' is the synthetic runner's; the {self.runner} runner's "
                             "windows come from its model config (runner_options.config layer_types and "
                             "sliding_window)" if self.runner.startswith("paddleformers:") else
                             f"setting 'layer_windows' is the synthetic runner's; the {self.runner} runner has "
                             "no sliding-window layers")
        if self.runner == "synthetic":
            return _parse_windows(self.layer_windows, self.layers) if self.layer_windows else ()
        if not self.runner.startswith("paddleformers:"):
            return ()
        from fastkv.engine.runners.paddleformers_config import model_windows

        try:
            windows = model_windows(self.runner.removeprefix("paddleformers:"), self.layout(), self.runner_options)
        except (ValueError, TypeError, KeyError):
            return ()  # _check_paddleformers names what is wrong with the settings
        return windows if any(windows) else ()

    def _unsupported_by_groups(self) -> list[str]:
        """What this run asks for that KV cache groups do not run with yet, by flag."""
        from fastkv.events.config import SCHEMAS

        events = self.kv_events_endpoint or self.kv_events_replay_endpoint
        schema = self.kv_events_schema or SCHEMAS[0]
        asked = [("--storage", self.storage not in ("default", "none")),
                 (f"--preemption {self.preemption}", self.preemption == "storage"),
                 (f"--role {self.role}", self.role != "mixed"),
                 ("--update-weights-at", bool(self.update_weights_at)),
                 (f"--kv-events-schema {schema} (a block's KV cache group needs --kv-events-schema vllm)",
                  bool(events) and schema != "vllm")]
        return [flag for flag, used in asked if used]

    def _group_blocks(self) -> tuple[int, ...]:
        """A hybrid's device blocks per KV cache group: the bytes of ``device_blocks`` blocks of
        every layer, split in the proportion the workload's requests need them
        (``split_device_tier``: a full group a request's every block, a sliding group its window's,
        and room for the longest prompt's chunk while it prefills)."""
        layout = self.layout()
        if not layout.is_hybrid:
            return ()
        from fastkv.cache.groups import split_device_tier

        requests = self.requests()
        lengths = [len(r["prompt"]) + r["max_new_tokens"] for r in requests] or [self.block_size]
        budget = self.scheduler.get("max_num_batched_tokens", SchedulerConfig().max_num_batched_tokens)
        chunk = min(budget, max([len(r["prompt"]) for r in requests] or [1]))
        try:
            return tuple(split_device_tier(layout, self.device_blocks * layout.block_bytes,
                                           -(-sum(lengths) // len(lengths)), chunk))
        except ValueError as exc:
            raise ValueError(f"setting 'device_blocks' {self.device_blocks}: {exc}") from None

    def _kv_cache_dtype(self) -> None:
        if self.kv_cache_quant_type:
            if self.kv_cache_dtype != "auto":
                raise ValueError("give the KV cache dtype as 'kv_cache_dtype' or as 'kv_cache_quant_type', not both")
            quant = FASTDEPLOY_QUANT_TYPES.get(self.kv_cache_quant_type)
            if quant is None:
                raise ValueError(f"setting 'kv_cache_quant_type' must be one of {tuple(FASTDEPLOY_QUANT_TYPES)}, "
                                 f"got {self.kv_cache_quant_type!r}")
            object.__setattr__(self, "kv_cache_dtype", quant)
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"setting 'kv_cache_dtype' must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype != "auto" and self.dtype != JobConfig.dtype:
            raise ValueError(f"give the KV dtype as 'dtype' or as 'kv_cache_dtype', not both (got {self.dtype!r} "
                             f"and {self.kv_cache_dtype!r})")

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
        flags = {k for k, v in (overrides or {}).items() if v is not None}
        try:
            with in_file(path):
                cfg = cls(**values)
        except ValueError as exc:  # a setting the user gave as a flag is named as the flag
            raise ValueError(_SETTING.sub(lambda m: flag_name(m[1]) if m[1] in flags else m[0], str(exc))) from None
        object.__setattr__(cfg, "overridden", notes)
        return cfg

    def layout(self) -> KVLayout:
        shape = dict(num_layers=self.layers, kv_heads=self.kv_heads, block_size=self.block_size,
                     head_dim=self.head_dim, tp_size=self.tp, mla=self.kv_layout == "mla")
        shape["windows"] = getattr(self, "windows", ())  # set once KV cache groups are decided
        if self.kv_cache_dtype != "auto":
            return KVLayout.of(self.kv_cache_dtype, **shape)
        return KVLayout(**shape, dtype=self.dtype)

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
        if self.storage == "default" and getattr(self, "windows", ()):  # nor with KV cache groups (not per group yet)
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
            run_id=run_id, layout=self.layout(), num_device_blocks=self.device_blocks, group_blocks=self.group_blocks,
            num_host_blocks=self.host_blocks, storage_url=self.storage_url(out_dir), runner=self.runner,
            runner_options=self.full_runner_options(),
            cache_policy=self.cache_policy, storage_writes=self.storage_write, eviction=self.eviction,
            host_checksums=self.host_checksums, async_scheduling=self.async_scheduling == "on",
            layerwise_load=self.layerwise_load == "on",
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




def _parse_windows(text: str, layers: int) -> tuple[int, ...]:
    """``layer_windows``: comma-separated windows (0 full), repeated over ``layers`` layers."""
    try:
        pattern = [int(w) for w in text.split(",")]
    except ValueError:
        pattern = []
    if not pattern or min(pattern) < 0:
        raise ValueError(f"setting 'layer_windows' must be comma-separated windows >= 0 (0: full attention), "
                         f"e.g. \"128,0\"; got {text!r}")
    if layers % len(pattern):
        raise ValueError(f"setting 'layer_windows' {text!r} names {len(pattern)} layers, which do not repeat "
                         f"evenly over the {layers} layers")
    return tuple(pattern * (layers // len(pattern)))


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


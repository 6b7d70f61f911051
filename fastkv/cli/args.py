"""``fastkv-supervisor``'s argument table: one flag per ``JobConfig`` setting (``None`` when
not given, so that the config file and the defaults show through), and its checks."""
from __future__ import annotations

import argparse
import dataclasses
from typing import Any

from fastkv.cache.eviction import POLICIES
from fastkv.cli.job import (
    CACHE_POLICIES,
    DEMO_DEVICE_BLOCKS,
    KV_CACHE_GROUPS,
    ROLES,
    RUNNERS,
    STORAGE_WRITES,
    JobConfig,
)
from fastkv.config import KV_CACHE_DTYPES, KV_LAYOUTS
from fastkv.events.config import SCHEMAS as EVENT_SCHEMAS
from fastkv.procs.cpu_policy import CPU_POLICIES
from fastkv.sched.hits import HIT_POLICIES
from fastkv.sched.prefetch import PREFETCH_POLICIES
from fastkv.workload import PREEMPTION_MODES


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
    a("--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="vLLM's name: the KV dtype; auto (default) = --dtype; "
      "fp8_e4m3 and int8 store one byte per value and a float32 scale per token-head (the config file also "
      "takes FastDeploy's kv_cache_quant_type = int8 | fp8)")
    a("--kv-layout", choices=KV_LAYOUTS, help="kv (default): a K and a V per layer; mla: one latent of "
      "--head-dim values per token and layer, the same on every rank (needs --kv-heads 1 and --runner tiny)")
    a("--device-blocks", type=int, help=f"device tier capacity in blocks per rank (default {DEMO_DEVICE_BLOCKS}; "
      "a trace or a workload file defaults to room for its longest request, up to 1 GiB per rank); with KV "
      "cache groups, the bytes of this many blocks of every layer, split between the groups")
    a("--host-blocks", type=int, help="host tier capacity in blocks per rank, 0 = none (default 1024; none "
      "with KV cache groups); under write-through, running requests hold their host copies: give it more "
      "blocks than the device tier")
    a("--storage", help="storage URL (lmdb://DIR, redis://HOST:PORT, mooncake://MASTER:PORT?..., mooncake://local "
      "= a Mooncake pool of this run's own), 'none', or 'default' = lmdb://<out>/store")
    a("--preemption", choices=PREEMPTION_MODES, help="what preempting a request does (default offload; "
      "recompute with KV cache groups)")
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
    a("--layerwise-load", choices=("on", "off"), help="on (default): a step starts while the host -> device "
      "copies it waits for land layer by layer, each layer's compute once its KV landed; off: the step waits "
      "for the whole copy (outputs are the same)")
    a("--engine-cpu-policy", choices=CPU_POLICIES, help="the engine thread's Linux scheduling policy: batch "
      "(default: a worker's output wakes the engine without the engine preempting that worker) or normal")
    a("--eviction", choices=sorted(POLICIES), help="the order cached blocks leave a tier (default lru)")
    a("--runner", choices=RUNNERS, help="reference model runner (default synthetic)")
    a("--kv-cache-groups", choices=KV_CACHE_GROUPS, help="a model with sliding-window layers (gemma3, gpt_oss, "
      "--layer-windows): on caches a sliding layer's window only, one KV cache group per window, with no host "
      "tier and recompute preemption by default; off caches every layer in full; auto (default) is on unless "
      "the run asks for a host tier, storage, offload, --role, weight updates or array-form KV events")
    a("--layer-windows", metavar="W,W,..", help="the synthetic runner's attention window per layer, repeated over "
      "--layers (\"128,0\": sliding 128, full, ...; 0 = full)")
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



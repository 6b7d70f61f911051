"""What an engine holds and has done, for its summary and for a server's health checks.

``counters(engine)``: the run's counters, the engine-side part of summary.json (docs/FORMATS.md).
``snapshot(engine)``: ``Engine.health()``: blocks per tier and state, unfinished requests per
state, copies in flight, the weights version, and ``counters``.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastkv.run import VERIFY_COUNTERS, RunSpec

if TYPE_CHECKING:
    from fastkv.engine.core import Engine


def snapshot(engine: Engine, queued: int) -> dict[str, Any]:
    """``queued``: requests not in the scheduler yet (added from another thread, or waiting for
    their storage lookup)."""
    counts = engine.sched.counts()
    in_flight = counts.pop("copies_in_flight")
    counts["queued"] = queued
    return {"blocks": engine.metrics.blocks(), "requests": counts, "copies_in_flight": in_flight,
            "weights_version": engine.weights_version, "counters": counters(engine)}


def counters(engine: Engine) -> dict[str, Any]:
    sig, ranks = engine.ends.signals, range(engine.spec.tp_size)
    gpu = engine.gpu_clock.summary(gpu_byte_work_s(engine.spec, sig))
    return {
        **engine.metrics.summary(),
        # modelled GPU seconds / wall seconds from the first step to the last, and where the
        # rest went (fastkv.engine.timeline.GpuClock)
        "gpu_busy": gpu["gpu_busy"],
        "gpu_time": gpu["gpu_time"],
        # Storage faults (a tier that fails mid-run degrades to recompute; these say how much).
        "storage_errors": engine.ends.signals["storage.errors"],
        "corrupt_values": engine.ends.signals["storage.corrupt"],
        "recomputed_because_storage": engine.cache.stats.storage_lost_tokens,
        # device blocks computed or loaded again while another copy of the same prefix block was there
        "duplicate_blocks": engine.cache.stats.duplicate_blocks,
        # host copies not made when due for want of a free host block, those of them made later,
        # and host evictions of blocks the storage tier does not hold: what a shared store misses
        "host_copies_skipped": engine.cache.stats.skipped_copies,
        "host_copies_made_late": engine.cache.stats.late_copies,
        # running requests that let go of their hold on their host copies for a write-back, an
        # offload or a load (a host tier too small for them: fastkv.cache.tiering.make_host_room)
        "host_chain_spills": engine.cache.stats.chain_spills,
        "unstored_host_evictions": engine.cache.stats.unstored_host_evictions,
        # blocks written to the storage tier, and those a write policy wanted stored but skipped
        # because the storage tier was behind (fastkv.cache.storage_writes): never a stalled step
        "storage_blocks_stored": engine.cache.stats.store_blocks,
        "storage_blocks_skipped": sum(n for r, n in engine.cache.skipped_stores().items() if r != "already_stored"),
        "storage_blocks_stored_late": engine.cache.stats.late_stores,  # deferred, stored once storage caught up
        # why blocks a write policy wanted stored were not: the pool held them, or storage was
        # behind and they were unshared tails or (last) shared prefixes (fastkv.cache.store_backlog)
        "storage_blocks_skipped_by": engine.cache.skipped_stores(),
        # what the shared store was asked at admission and what it confirmed (fastkv.engine.lookup)
        "storage_lookup": {} if engine.lookups is None else {
            **engine.lookups.stats.to_json(),
            "bytes_loaded": engine.cache.stats.load_blocks * engine.spec.layout.block_bytes * engine.spec.tp_size,
            "blocks_loaded": engine.cache.stats.load_blocks,
            "loads_joined": engine.cache.stats.joined_load_blocks},  # blocks taken from another's LOAD
        # prompt tokens of host and storage hits loaded, and those recomputed by the hit policy's choice
        "hits": engine.sched.hits.to_json(),
        # what the workers' runners verified (summed over ranks; requests: each rank checks the
        # same requests, so the most any rank checked); a mismatch fails the run
        "verified": {c: (max if c == "kv_requests_verified" else sum)(sig[f"worker{r}.{c}"] for r in ranks)
                     for c in VERIFY_COUNTERS},
        "runner": engine.spec.runner, "tp": engine.spec.tp_size, "role": engine.spec.role,
        # the KV's dtype and one token's bytes on one rank, scales included: what every tier moves
        "kv_cache_dtype": engine.spec.layout.kv_cache_dtype, "kv_bytes_per_token": engine.spec.layout.bytes_per_token,
        "kv_layout": "mla" if engine.spec.layout.mla else "kv",  # --kv-layout
        "host_checksum_mismatches": sum(sig[f"transfer{r}.host_checksum_mismatches"] for r in ranks),
        "weight_updates": engine.weight_updates,
        # a sliding-window hybrid layout's KV cache groups (fastkv.cache.group_manager): per group its
        # blocks, those held and cached now, the most one request held between steps, its hit blocks
        "kv_groups": engine.cache.group_summary(),
        # steps planned and sent while the one before ran (async scheduling; 0 when off)
        "async_scheduling": {"on": engine.async_scheduling, "overlapped_steps": engine.overlapped_steps,
                             "steps": engine.sched.stats.steps, "sync_plans": engine.sync_plans,
                             "step_wall_s": round(engine.step_wall_s, 4),
                             "step_worker_s": round(engine.gpu_clock.gpu_s, 4)},
        # layer-wise loading: SWAP_INs copied layer by layer, and the plans whose layers waited for one
        # still landing into their blocks (fastkv.transfer.landing)
        "layerwise_load": {"on": engine.spec.layerwise_load,
                           "layered_swap_ins": getattr(getattr(engine.transfer, "landing", None), "numbered", 0),
                           "plans_on_landing_copies": engine.plans_on_landing},
        # KV computed under older weights that a request read (the synthetic runner checks): must be 0
        "stale_hits": sum(sig[f"worker{r}.kv_stale_hits"] for r in ranks),
        # memory the weight updates gave back (free_memory_on_update), measured as each tier's resident bytes
        "released_bytes": {"device": sum(sig[f"worker{r}.released_bytes"] for r in ranks),
                           "host": sum(sig[f"transfer{r}.released_bytes"] for r in ranks)},
        # KV events (fastkv.events): batches, those dropped from the live stream, replays served;
        # the namespace fingerprint a router derives block keys from (fastkv.routing.block_hashes)
        "kv_events": {} if engine.events is None else {
            **engine.events.stats(), "namespace": engine.cache.namespace.fingerprint.hex(),
            "resident": engine.events.resident()},
    }


def gpu_byte_work_s(spec: RunSpec, sig: Any) -> float:
    """Under a cost model, the synthetic runner's own byte work (``synthetic_us``, mean over
    ranks: they do theirs side by side) stands for GPU work inside a step, outside the modelled
    time a step reports. Without one, a step's reported time already includes it."""
    if not spec.runner_options.get("cost_model"):
        return 0.0
    return sum(sig[f"worker{r}.synthetic_us"] for r in range(spec.tp_size)) / spec.tp_size / 1e6

"""The --quick demo workload, run in-process (scheduler, cache, fake worker and transfer) with KV
events on: offload pressure, copies completing across steps, a weight update and a
reset_prefix_cache, and the engine's own per-tier index to compare subscribers with."""
from __future__ import annotations

from collections.abc import Callable

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.write_policy import StorageWrites, Tier
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.cli import QUICK_DEMO
from fastkv.events import EventsConfig, KVEvents
from fastkv.sched import PreemptionMode, Scheduler, SchedulerConfig, WeightUpdate
from fastkv.workload import ConversationConfig, conversations
from tests.events import spec_keys
from tests.sched_harness import Rig

BS = 16
MEDIA = {Tier.DEVICE: "GPU", Tier.HOST: "CPU", Tier.STORAGE: "DISK"}


def make_rig(events: EventsConfig) -> tuple[Rig, KVEvents]:
    cache = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=96, block_size=BS,
                                     policy=CachePolicy.WRITE_THROUGH, storage=True,
                                     storage_writes=StorageWrites.THROUGH, storage_keys=120))
    sched = Scheduler(cache, SchedulerConfig(preemption=PreemptionMode.OFFLOAD, max_num_batched_tokens=256))
    rig = Rig(sched, vocab=1024)
    return rig, KVEvents(cache, events)


def chained_keys(rig: Rig) -> set[bytes]:
    """Every chained key any request's tokens have under the current or an earlier namespace:
    computed from the key spec by the test's own code (spec_keys), independently of the cache."""
    cache = rig.sched.cache
    out: set[bytes] = set()
    for ns in [*cache.state.retired, cache.namespace]:
        fingerprint = spec_keys.namespace(ns.model_id, ns.weights_version, ns.layout, ns.kv_dtype, ns.block_size,
                                          ns.tp_size)
        for truth in rig.worker.truth.values():
            out.update(spec_keys.chain(truth.tokens, fingerprint, BS))
    return out


def engine_index(rig: Rig) -> dict[str, set[bytes]]:
    """The engine's own index per medium: each tier's residency map, chained keys only."""
    cache = rig.sched.cache
    chained = chained_keys(rig)
    maps = {Tier.DEVICE: cache.device.lookup, Tier.HOST: cache.host.lookup, Tier.STORAGE: cache.index.stored}
    return {MEDIA[t]: {k for k in m if k in chained} for t, m in maps.items()}


def run_demo(events: EventsConfig, on_step: Callable[[int, Rig, KVEvents], None] = lambda i, r, e: None,
             max_steps: int = 20_000) -> tuple[Rig, KVEvents]:
    """Half the demo's requests, a weight update (drained), the other half with a
    reset_prefix_cache midway. Copies complete half at a time, so some fly across steps."""
    rig, ev = make_rig(events)
    reqs = conversations(ConversationConfig(**QUICK_DEMO))
    half = len(reqs) // 2
    for i, r in enumerate(reqs[:half]):
        rig.add(i, r["prompt"], r["max_new_tokens"])
    s = rig.sched
    phase, step = 0, 0
    while step < max_steps:
        out = rig.step()
        pending = len(rig.transfer.pending)
        for _ in range(pending // 2 if out.plan.seqs else pending):
            rig.complete(0)
        ev.flush()
        on_step(step, rig, ev)
        step += 1
        if phase == 0 and len(rig.finished) >= half // 2:
            s.begin_weight_update(drain=True)
            phase = 1
        elif phase == 1 and s.weight_update_state is WeightUpdate.READY:
            s.finish_weight_update("v2")
            for i, r in enumerate(reqs[half:], start=half):
                rig.add(i, r["prompt"], r["max_new_tokens"])
            phase = 2
        elif phase == 2 and len(rig.finished) >= half + half // 2:
            s.cache.reset_prefix_cache()
            phase = 3
        elif phase == 3 and not s.has_work() and not rig.transfer.pending:
            break
    assert phase == 3 and len(rig.finished) == len(reqs), f"demo did not finish: phase {phase}, {s.counts()}"
    ev.flush()
    return rig, ev

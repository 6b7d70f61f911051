"""Byte-level: the scheduler drives the synthetic runner over real numpy KV caches, with a
transfer layer that really copies device <-> host <-> storage bytes, completing in random order.

The runner verifies every byte of every sequence before every step (``verify="all"``), so a
restore that brought back the wrong bytes, or a block reused while still needed, fails here.
Outputs must equal the synthetic model's, computed from the prompts alone (``reference_output``):
its next token is a function of the KV the runner reads, so a wrong prefix hit changes them.
"""
import numpy as np
import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.write_policy import WritePolicy as CachePolicy
from fastkv.config import KVLayout
from fastkv.engine.runners.synthetic import SyntheticRunner, reference_output
from fastkv.sched import PreemptionMode, Request, Scheduler, SchedulerConfig
from tests.sched_harness import run_step

LAYOUT = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=12, dtype="bfloat16")


class ByteTransfer:
    def __init__(self, k, v, num_host_blocks: int, rng) -> None:
        self.k, self.v = k, v
        self.host = np.zeros(LAYOUT.host_shape(num_host_blocks), LAYOUT.numpy_dtype)
        self.storage: dict[bytes, np.ndarray] = {}
        self.pending = []
        self.rng = rng

    def run(self, p) -> bool:
        if p.kind is CopyKind.SWAP_OUT:
            for layer in range(LAYOUT.num_layers):
                self.host[p.dst, layer, 0] = self.k[layer][p.src]
                self.host[p.dst, layer, 1] = self.v[layer][p.src]
        elif p.kind is CopyKind.SWAP_IN:
            for layer in range(LAYOUT.num_layers):
                self.k[layer][p.dst] = self.host[p.src, layer, 0]
                self.v[layer][p.dst] = self.host[p.src, layer, 1]
        elif p.kind is CopyKind.STORE:
            for b, key in zip(p.src.tolist(), p.keys, strict=True):
                self.storage[key] = self.host[b].copy()
        elif p.kind is CopyKind.LOAD:
            if not all(key in self.storage for key in p.keys):
                return False
            for b, key in zip(p.dst.tolist(), p.keys, strict=True):
                self.host[b] = self.storage[key]
        return True

    def finish_some(self, sched, everything: bool = False) -> None:
        """Complete a random subset of the pending plans, in random order."""
        self.rng.shuffle(self.pending)
        keep = []
        for p in self.pending:
            if everything or self.rng.random() < 0.6:
                sched.on_copy_complete(p, self.run(p), nbytes=p.num_blocks * LAYOUT.block_bytes, seconds=1e-4)
            else:
                keep.append(p)
        self.pending = keep


def serve(prompts, max_new, dev, mode, host=16, storage=False, cache_policy=CachePolicy.WRITE_BACK, seed=0):
    rng = np.random.default_rng(seed)
    k = [np.zeros(LAYOUT.device_shape(dev), LAYOUT.numpy_dtype) for _ in range(LAYOUT.num_layers)]
    v = [np.zeros(LAYOUT.device_shape(dev), LAYOUT.numpy_dtype) for _ in range(LAYOUT.num_layers)]
    runner = SyntheticRunner(LAYOUT, 0, 1, k, v, vocab=97, verify="all")
    cache = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=LAYOUT.block_size,
                                     policy=cache_policy, storage=storage, layout=LAYOUT))
    sched = Scheduler(cache, SchedulerConfig(max_num_batched_tokens=24, preemption=mode))
    xfer = ByteTransfer(k, v, host, rng)
    for rid, p in enumerate(prompts):
        sched.add_request(Request(rid, np.array(p, np.int32), max_new))
    outputs = {}
    for _ in range(5000):
        if not sched.has_work():
            break
        out = sched.step()
        xfer.pending += out.copies
        run_step(sched, runner, out, outputs)
        xfer.finish_some(sched, everything=not out.plan.seqs)
        sched.check_integrity()
    assert not sched.has_work(), sched.counts()
    return outputs, sched.stats


PROMPTS = [list(range(10 * i + 1, 10 * i + 1 + n)) for i, n in enumerate([9, 14, 6, 11, 7, 13])]
PROMPTS += [PROMPTS[1][:8] + [3, 3, 3], PROMPTS[3][:8] + [5]]  # shared prefixes


@pytest.fixture(scope="module")
def reference():
    """Computed without any cache: the synthetic model's tokens for each prompt."""
    return {rid: reference_output(p, 10, 97, LAYOUT.dtype) for rid, p in enumerate(PROMPTS)}


def test_reference_matches_a_run_that_never_preempts(reference):
    outputs, stats = serve(PROMPTS, 10, dev=64, mode=PreemptionMode.RECOMPUTE)
    assert outputs == reference and stats.preemptions == 0


@pytest.mark.parametrize("mode", [PreemptionMode.RECOMPUTE, PreemptionMode.OFFLOAD, PreemptionMode.AUTO])
def test_byte_exact_under_preemption(reference, mode):
    outputs, stats = serve(PROMPTS, 10, dev=12, mode=mode)
    assert outputs == reference
    assert stats.preemptions > 0
    if mode is PreemptionMode.OFFLOAD:
        assert stats.preempt_offload > 0 and stats.restored > 0 and stats.recomputed_tokens == 0


def test_byte_exact_through_storage(reference):
    outputs, stats = serve(PROMPTS, 10, dev=12, host=10, storage=True, mode=PreemptionMode.STORAGE,
                           cache_policy=CachePolicy.WRITE_THROUGH, seed=3)
    assert outputs == reference and stats.preempt_storage > 0

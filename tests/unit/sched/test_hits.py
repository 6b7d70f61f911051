"""The hit policy: which host and storage hits admission loads, judged by a pool deployment's costs."""
from __future__ import annotations

import pytest

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.deploy.cost_model import ScaledCostModel, deployment
from fastkv.sched.hits import HitCosts, HitPolicy

BS = 16
LAYOUT = KVLayout(num_layers=4, kv_heads=2, block_size=BS, head_dim=64, dtype="float32")


def policy(pool: str, name: str = "auto") -> HitPolicy:
    model = ScaledCostModel.calibrate(deployment(f"llama3-8b-h100-sxm-{pool}"), LAYOUT.block_bytes // BS, 10e9)
    return HitPolicy(BS, name, HitCosts.of(model, BS, LAYOUT.block_bytes))


def test_auto_recomputes_a_10gbe_pool_hit_and_loads_a_100gbe_one():
    slow, fast = policy("pool10g"), policy("pool100g")
    assert slow.cut(2, 0, 40, (0, 0)) == (0, 0)
    assert fast.cut(2, 0, 40, (0, 0)) == (0, 40)
    assert slow.stats.recomputed_tokens == {"host": 0, "storage": 40 * BS} and slow.stats.decisions == 1
    assert fast.stats.loaded_tokens == {"host": 0, "storage": 40 * BS}
    assert slow.stats.recompute_s > 0 and fast.stats.load_s > 0


def test_host_hits_load_over_pcie_even_beside_a_slow_pool():
    p = policy("pool10g")
    assert p.cut(0, 8, 20, (0, 0)) == (8, 0)  # the host run loads; the pool's run after it does not


def test_forced_policies_ignore_the_costs():
    assert policy("pool10g", "load").cut(0, 3, 20, (0, 0)) == (3, 20)
    forced = policy("pool100g", "recompute")
    assert forced.cut(0, 3, 20, (0, 0)) == (0, 0)
    assert forced.stats.recomputed_tokens == {"host": 3 * BS, "storage": 20 * BS}
    assert HitPolicy(BS).cut(0, 3, 20, (0, 0)) == (3, 20)  # auto with no cost model: every hit


def test_a_queue_on_the_link_makes_even_a_fast_pool_recompute():
    p = policy("pool100g")
    assert p.cut(0, 0, 10, (0, 0)) == (0, 10)
    assert p.cut(0, 0, 10, (0, 100_000)) == (0, 0)
    assert p.cut(0, 0, 10, (100_000, 0)) == (0, 10)  # the host link's queue is not the pool's
    assert p.cut(0, 4, 10, (10**9, 0)) == (0, 0)  # a host run cut short: nothing after it can load


def test_deep_in_a_long_context_a_10gbe_load_beats_attention():
    # a token's prefill grows with the context it attends over; its KV's bytes do not
    slow = policy("pool10g")
    assert slow.cut(0, 0, 40, (0, 0)) == (0, 0)
    assert slow.cut(8000, 0, 40, (0, 0)) == (0, 40)
    c = slow.costs
    assert 40 * c.block_bytes * c.seconds_per_byte[1] <= c.prefill(8000 * BS, 8040 * BS)


def test_a_measured_load_slower_than_the_model_is_believed():
    p = policy("pool100g")
    assert p.cut(0, 0, 40, (0, 0)) == (0, 40)
    p.observe(True, 1 << 20, 10.0)  # LOADs here take far longer than the link's share
    assert p.cut(0, 0, 40, (0, 0)) == (0, 0)


def test_a_look_ahead_counts_nothing():
    p = policy("pool10g")
    p.cut(0, 0, 40, (0, 0), count=False)
    assert p.stats.decisions == 0 and p.stats.recomputed_tokens["storage"] == 0


def test_bad_policy_is_named():
    with pytest.raises(ValueError, match="hit policy must be one of"):
        HitPolicy(BS, "sometimes")


def stored_prompt(m: CacheManager, n_blocks: int) -> list[int]:
    prompt = list(range(1000, 1000 + n_blocks * BS + 1))
    m.confirm_stored(m.keys_for(prompt)[:n_blocks])
    return prompt


def test_allocate_recomputes_what_the_policy_cuts():
    m = CacheManager(CacheConfig(num_device_blocks=64, num_host_blocks=32, block_size=BS, storage=True))
    prompt = stored_prompt(m, 6)
    asked = []
    a = m.allocate("cut", prompt, hits=lambda *n: asked.append(n) or (0, 2))
    assert asked == [(0, 0, 6)]
    (load,) = [p for p in a.plans if p.kind is CopyKind.LOAD]
    assert len(load.keys) == 2 and a.num_pending_tokens == 2 * BS  # blocks 2.. are recomputed
    b = m.allocate("all", list(range(5000, 5000 + 6 * BS + 1)), hits=lambda *n: (0, 0))
    assert b.ready and b.num_cached_tokens == 0 and not b.plans

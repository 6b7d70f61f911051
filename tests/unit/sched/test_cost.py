"""Auto preemption's cost model chooses per request: short contexts recompute, long ones copy."""
from __future__ import annotations

import pytest

from fastkv.sched.config import SchedulerConfig
from fastkv.sched.cost import CostModel

BLOCK = 16
BLOCK_BYTES = 64 << 10


def model(**kw) -> CostModel:
    # ~5 us of prefill per token, 10 GB/s copies, 200 us per copy task: the cost-model runner here
    return CostModel(BLOCK_BYTES, 10e9, 200_000.0, copy_latency=200e-6, **kw)


def choice(m: CostModel, tokens: int) -> bool:
    return m.prefer_offload(tokens, -(-tokens // BLOCK), 0, 0.0)


def test_short_contexts_recompute_and_long_ones_offload():
    m = model()
    assert not choice(m, 32)  # 160 us of prefill against two 200 us round trips
    assert choice(m, 2048)  # 10 ms of prefill against ~1.1 ms of copies
    # The break-even point lies between, and the choice flips once.
    flips = [choice(m, n) for n in range(16, 2048, 16)]
    assert flips == sorted(flips)


def test_host_copies_a_recompute_does_not_hold_are_charged_at_their_risk():
    # A 2048-token victim whose full blocks all have host copies: offloading copies its partial
    # block out and back (two 200 us round trips); recomputing computes 10 tokens again if its
    # host copies last (50 us), all 2048 if they are evicted (10 ms).
    m = model()
    assert not m.prefer_offload(10, 1, unheld_tokens=2038, risk=0.0)  # an empty host tier: they last
    assert m.prefer_offload(10, 1, unheld_tokens=2038, risk=1.0)  # a full one: pin them
    assert m.prefer_offload(10, 1, unheld_tokens=2038, risk=0.1)  # 1 ms expected against 0.4 ms
    assert not m.prefer_offload(10, 1, unheld_tokens=22, risk=1.0)  # a short victim recomputes anyway
    with pytest.raises(ValueError, match="risk"):
        m.prefer_offload(10, 1, unheld_tokens=22, risk=1.5)


def test_bandwidth_estimate_leaves_the_per_task_latency_out():
    m = model()
    nbytes = 1 << 20
    m.observe_copy(nbytes, 200e-6 + nbytes / 4e9)
    assert m.copy_bandwidth == pytest.approx(4e9)
    m.observe_copy(nbytes, 150e-6)  # faster than the latency: nothing to learn about bandwidth
    assert m.copy_bandwidth == pytest.approx(4e9) and m.copy_samples == 1


def test_scheduler_config_carries_the_latency_prior():
    assert SchedulerConfig().copy_latency_s > 0
    with pytest.raises(ValueError, match="copy_latency_s >= 0"):
        SchedulerConfig(copy_latency_s=-1.0)


def test_prefill_rate_is_the_marginal_one_beyond_the_decode_step_floor():
    # Under a roofline a step costs the weights' read (0.6 ms here) whatever it computes, and
    # each prefill token ~3.5 us beyond it: the rate that prices a recompute is 1 / 3.5 us.
    m = model()
    for _ in range(3):
        m.observe_step(0, 8, 600e-6)
    m.observe_step(500, 8, 600e-6 + 500 * 3.5e-6)
    assert m.prefill_rate == pytest.approx(1 / 3.5e-6, rel=1e-6)
    m.observe_step(100, 8, 550e-6)  # all of it rode on the floor: no rate to learn
    assert m.prefill_rate == pytest.approx(1 / 3.5e-6, rel=1e-6) and m.prefill_samples == 1


def test_nothing_to_copy_costs_no_copy():
    assert model().offload_seconds(0) == 0.0
    assert model().prefer_offload(3, 0, 0, 0.0)


def test_tasks_of_a_few_blocks_give_latency_and_bandwidth_apart():
    # The transfer path here: 300 us per task and 15 GB/s; tasks of 1 and 4 blocks. Charging
    # all beyond the 200 us prior to bandwidth would put it at ~1-3 GB/s.
    m = model()
    for i in range(12):
        nbytes = BLOCK_BYTES * (1 if i % 2 else 4)
        m.observe_copy(nbytes, 300e-6 + nbytes / 15e9)
    assert m.copy_bandwidth == pytest.approx(15e9, rel=1e-6)
    assert m.copy_latency == pytest.approx(300e-6, rel=1e-6)
    assert m.prefer_offload(480, 30, 0, 0.0)  # a long context with no host copy: 2 x 0.43 ms against 2.4 ms


def roofline_step(prefill: int, decode: int, floor: float, rate: float, jitter: float) -> float:
    """A GPU step under a roofline: the decode floor (the weights' read) or the compute of every
    token, whichever is longer, and a little noise."""
    return max(floor, (prefill + decode) / rate) * (1.0 + jitter)


def test_under_a_roofline_short_recomputes_ride_free_and_long_ones_pay_the_compute_rate():
    # 16 decodes on a 1 ms floor, 300k tokens/s of compute: ~284 prefill tokens ride free.
    # Steps within the floor's noise once put the rate at ~1e9 tokens/s (a long recompute free).
    import random

    floor, rate, decode = 1e-3, 300e3, 16
    free = floor * rate - decode
    rng = random.Random(7)
    m = model()
    for _ in range(200):
        prefill = rng.choice([0, 0, 0, 8, 40, 120, 250, 600, 1000, 1500, 2000])
        m.observe_step(prefill, decode, roofline_step(prefill, decode, floor, rate, rng.uniform(0, 0.03)))
    # An EWMA over ~10 steps with 3 % noise: within 15 % and 20 % for every seed of 300 tried.
    assert m.prefill_rate == pytest.approx(rate, rel=0.15)
    assert m.free_tokens == pytest.approx(free, rel=0.2)
    assert m.recompute_seconds(100) == 0.0
    assert m.recompute_seconds(1500) == pytest.approx((1500 - free) / rate, rel=0.25)
    assert not choice(m, 100)  # free beside the decodes: recompute
    assert choice(m, 1500)  # ~4 ms of compute against ~2 x 0.3 ms of copies: offload

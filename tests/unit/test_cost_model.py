"""The roofline cost model of a named deployment, and the synthetic runner waiting out its scaled step time."""
from __future__ import annotations

import time

import numpy as np
import pytest

from fastkv.cli import JobConfig
from fastkv.config import KVLayout
from fastkv.deploy.cost_model import (
    LLAMA3_8B_H100,
    LLAMA3_8B_H100_POOL,
    LLAMA3_70B_H100_TP4,
    ScaledCostModel,
    calibrate_for,
    deployment,
    with_kv_of,
)
from fastkv.engine.runners.synthetic import reference_output
from fastkv.sched.output import SeqWork, StepPlan
from tests.unit.test_synthetic_runner import layout, make

D = LLAMA3_8B_H100


def test_deployment_matches_the_public_model_card():
    assert D.weight_bytes / 2 == pytest.approx(8.03e9, rel=0.01)  # Llama-3-8B: 8.03 B parameters
    assert D.kv_bytes_per_token == 128 * 1024
    assert deployment("llama3-8b-h100-sxm") is D
    with pytest.raises(ValueError, match="unknown cost model 'a100'; choose one of"):
        deployment("a100")


def test_a_tensor_parallel_rank_holds_and_computes_its_share():
    big = LLAMA3_70B_H100_TP4
    assert big.tp * big.weight_bytes / 2 == pytest.approx(70.6e9, rel=0.01)  # Llama-3-70B: 70.6 B parameters
    assert big.kv_bytes_per_token == 2 * 80 * 8 * 128 * 2 // 4  # 80 KiB of each token's 320 KiB per rank
    assert deployment("llama3-70b-h100-sxm-tp4") is big
    whole = type(big)(**{**big.__dict__, "tp": 1})
    for seqs in ([(0, 2048)], [(999, 1000)] * 8, [(16000, 18048)]):
        assert big.step_seconds(seqs) == pytest.approx(whole.step_seconds(seqs) / 4, rel=1e-9)
    # What makes the choice of preemption matter more than on the 8B: a prefill token costs ~45
    # times its KV's copy over PCIe, against ~12 times.
    per_token = big.step_seconds([(0, 2048)]) / 2048
    assert 40 < per_token / big.copy_seconds_per_token() < 50
    assert 10 < D.step_seconds([(0, 2048)]) / 2048 / D.copy_seconds_per_token() < 14


def test_prefill_is_compute_bound_and_decode_bandwidth_bound():
    per_prefill_token = D.step_seconds([(0, 2048)]) / 2048
    assert 25e-6 < per_prefill_token < 40e-6  # ~30 us: an 8B GQA model's prefill token on an H100
    # A decode step reads every weight: batch 1 and batch 8 cost about the same, weights / HBM.
    one = D.step_seconds([(999, 1000)])
    eight = D.step_seconds([(999, 1000)] * 8)
    assert one == pytest.approx(D.weight_bytes / (D.hbm_bandwidth * D.hbm_efficiency), rel=0.01)
    assert one < eight < 1.1 * one
    # Attention: the same chunk costs more late in a long context than at its start.
    assert D.step_seconds([(16000, 18048)]) > 1.2 * D.step_seconds([(0, 2048)])
    assert D.step_seconds([]) == 0.0


def test_scaling_keeps_the_ratio_of_compute_to_copy_per_token():
    local_bytes, local_bw = 4096, 8e9
    m = ScaledCostModel.calibrate(D, local_bytes, local_bw)
    prefill = [(0, 1024)]
    local_ratio = m.step_seconds(prefill) / 1024 / (local_bytes / local_bw)
    gpu_ratio = D.step_seconds(prefill) / 1024 / (D.kv_bytes_per_token / (D.pcie_bandwidth * D.pcie_efficiency))
    assert local_ratio == pytest.approx(gpu_ratio)
    assert 8 < gpu_ratio < 16  # ~30 us of compute against ~2.6 us of PCIe per token
    with pytest.raises(ValueError, match="copy bandwidth"):
        ScaledCostModel.calibrate(D, local_bytes, 0)


def test_preemption_costs_show_a_decode_bound_step():
    m = ScaledCostModel.calibrate(D, 4096, 8e9)
    c = m.preemption_costs(batch=16, context=1024)
    assert c["copy_us_per_token"] == pytest.approx(1e6 * 4096 / 8e9)  # this machine's real copy
    assert 8 < c["recompute_us_per_token"] / c["copy_us_per_token"] < 16  # the GPU's ratio, as above
    # A decode step reads 16 GB of weights (~6 ms on the GPU): ~200 prefill tokens (~30 us each) ride on it.
    assert c["decode_step_us"] == pytest.approx(1e6 * m.step_seconds([(1023, 1024)] * 16))
    free = c["free_recompute_tokens"]
    assert 100 < free < 300
    decode = [(1023, 1024)] * 16
    assert m.step_seconds([*decode, (0, free)]) <= 1.05 * m.step_seconds(decode)
    assert m.step_seconds([*decode, (0, free + 1)]) > 1.05 * m.step_seconds(decode)


def test_runner_burns_the_scaled_step_time():
    runner, _, _ = make(layout("float32"), cost_model=D.name, copy_gbps=0.05)
    plan = StepPlan(0, [SeqWork(1, np.arange(40) % 7, 0, np.arange(10), True)])
    want = runner.cost.step_seconds([(0, 40)])
    assert want > 0.02  # a slow copy makes compute slow too
    out = runner.step(plan)
    assert out.seconds >= want


def test_runner_leaves_the_cpu_free_while_the_gpu_computes():
    """A GPU's compute takes no host CPU: the modelled step is waited out, so a 2-core host keeps
    its cores for the real copies (burning them made copies and compute take turns)."""
    runner, _, _ = make(layout("float32"), cost_model=D.name, copy_gbps=0.01)
    plan = StepPlan(0, [SeqWork(1, np.arange(40) % 7, 0, np.arange(10), True)])
    want = runner.cost.step_seconds([(0, 40)])
    assert want > 0.1
    cpu0 = time.thread_time()
    out = runner.step(plan)
    cpu = time.thread_time() - cpu0
    assert out.seconds >= want
    # burning got at least half a core even on a loaded 2-core machine
    assert cpu < 0.1 * want, f"the step burnt {cpu * 1e3:.1f} ms of CPU for {want * 1e3:.1f} ms of GPU compute"


def test_flat_cost_still_burns_cpu():
    """The flat cost stands for CPU compute (the tiny decoder's): it does take the CPU."""
    runner, _, _ = make(compute_us_per_token=10000.0)
    cpu0 = time.thread_time()
    runner.step(StepPlan(0, [SeqWork(1, np.arange(5), 0, np.array([0, 1]), True)]))
    assert time.thread_time() - cpu0 >= 0.01  # of 50 ms burnt: a fifth, generous for a loaded machine


def test_runner_takes_a_cost_model_or_a_flat_cost_not_both():
    with pytest.raises(ValueError, match="compute_us_per_token or cost_model, not both"):
        make(cost_model=D.name, compute_us_per_token=300.0)


def test_job_config_replaces_the_flat_default_and_rejects_unknown_names():
    opts = JobConfig(runner_options={"cost_model": D.name}).full_runner_options()
    assert opts["cost_model"] == D.name and "compute_us_per_token" not in opts
    assert JobConfig().full_runner_options()["compute_us_per_token"] == 300.0
    with pytest.raises(ValueError, match="unknown cost model 'h100'"):
        JobConfig(runner_options={"cost_model": "h100"})


def test_the_runners_own_byte_work_comes_before_the_modelled_compute_and_is_counted():
    """Making and checking the synthetic bytes stands for the GPU's work, not this CPU's: a step
    waits the modelled time out after it (hidden under it, it charged recompute and resuming at
    this CPU's rates), counts it in synthetic_us, and reports the modelled time alone."""
    runner, _, _ = make(layout("float32"), blocks=65, cost_model=D.name, copy_gbps=1.0, verify="all")
    table = np.arange(65)
    runner.step(StepPlan(0, [SeqWork(1, np.arange(256) % 7, 0, table, True)]))
    before = runner.checks()["synthetic_us"]
    t0 = time.perf_counter()
    out = runner.step(StepPlan(1, [SeqWork(1, np.array([3]), 256, table, True)]))  # checks 256 positions
    wall = time.perf_counter() - t0
    own = (runner.checks()["synthetic_us"] - before) * 1e-6
    want = runner.cost.step_seconds([(256, 257)])
    assert own > 0
    assert wall >= want + own
    assert want <= out.seconds <= wall - own + 1e-3


def test_storage_keeps_the_deployments_ratio_to_the_copies():
    """A block's STORE takes, here, its copy time here times the deployment's PCIe / storage ratio."""
    local_token, gbps = 32 << 10, 12e9
    for dep, link in ((D, 6e9), (LLAMA3_8B_H100_POOL, 12.5e9)):
        m = ScaledCostModel.calibrate(dep, local_token, gbps)
        block = 16 * local_token
        copy = m.scale * 16 * dep.copy_seconds_per_token()  # a block's copy under the model, here
        assert copy == pytest.approx(block / gbps)
        assert m.storage_seconds(block) == pytest.approx(copy * 64e9 / link)  # both links at 80 %
    assert deployment("llama3-8b-h100-sxm-pool100g").storage == "100gbe"
    with pytest.raises(ValueError, match="copy bandwidth"):
        ScaledCostModel(D, 1.0).storage_seconds(1)


def test_the_transfer_process_throttles_storage_only_under_a_cost_model():
    from fastkv.run import RunSpec
    from fastkv.transfer.executor import storage_time_model

    spec = JobConfig(layers=16, kv_heads=8, dtype="bfloat16").layout()
    base = RunSpec(run_id="t", layout=spec, num_device_blocks=4, num_host_blocks=4, runner="synthetic",
                   runner_options={"cost_model": D.name, "copy_gbps": 12.0})
    seconds = storage_time_model(base)
    assert seconds(spec.block_bytes) == pytest.approx(
        ScaledCostModel.calibrate(D, spec.block_bytes // spec.block_size, 12e9).storage_seconds(spec.block_bytes))
    assert storage_time_model(RunSpec(**{**base.__dict__, "runner_options": {}})) is None


@pytest.mark.parametrize("quant", ["fp8_e4m3", "int8"])
def test_a_quantized_layout_moves_its_bytes_at_the_same_modelled_compute(quant):
    """fp8 / int8 KV: the deployment copies and stores one byte per value plus a scale per token-head,
    while its compute stays bf16's: the scale (compute against this machine's copies) is unchanged."""
    shape = dict(num_layers=16, kv_heads=8, block_size=16, head_dim=64)
    bf16 = KVLayout(**shape, dtype="bfloat16")
    q = KVLayout.of(quant, **shape)
    dep = with_kv_of(D, q)
    assert dep.kv_bytes_per_token == 2 * 32 * 8 * (128 + 4) and with_kv_of(D, bf16) is D
    a, b = calibrate_for(D, bf16, 10e9), calibrate_for(D, q, 10e9)
    # (within the scales' share: 4 bytes per 64 values here, per 128 in the deployment)
    assert b.scale == pytest.approx(a.scale, rel=0.04)
    assert b.deployment.copy_seconds_per_token() < 0.52 * a.deployment.copy_seconds_per_token()
    seqs = [(0, 512)]  # a prefill: compute bound, the same; a decode over a long context reads less KV
    assert b.step_seconds(seqs) == pytest.approx(a.step_seconds(seqs), rel=0.04)
    assert b.step_seconds([(8000, 8001)] * 64) < a.step_seconds([(8000, 8001)] * 64)


def test_the_synthetic_runner_writes_quantized_rows_as_bytes():
    lay = KVLayout.of("fp8_e4m3", num_layers=2, kv_heads=2, block_size=4, head_dim=16)
    runner, k, _ = make(lay, cost_model=D.name, copy_gbps=10.0)
    assert runner.cost.scale == pytest.approx(calibrate_for(D, lay, 10e9).scale)
    out = runner.step(StepPlan(0, [SeqWork(1, np.arange(6), 0, np.array([3, 4]), True)]))
    assert out.sampled[1] == reference_output(list(range(6)), 1, 1024, "uint8")[0]
    assert k[0][3].any() and k[0][4, :, :2].any() and not k[0][4, :, 2:].any()


def test_a_hybrids_sliding_layers_read_and_attend_over_their_window_only():
    """gpt-oss-20b: half its layers slide (w = 128). Its step reads and attends over what a
    brute-force count of each layer's positions gives; cached by groups, a request of L tokens
    holds the full layers' blocks and a window's worth of the sliding ones."""
    import dataclasses

    from fastkv.deploy.cost_model import GPT_OSS_20B_H100 as G

    def brute(start, end):
        attended = read = 0
        for w in G.windows:
            seen = set()
            for p in range(start, end):
                lo = max(0, p - w + 1) if w else 0
                attended += p + 1 - lo
                seen.update(range(lo, p + 1))
            read += len(seen)
        return attended, read * G.kv_bytes_per_layer_token

    for start, end in [(0, 1), (0, 100), (0, 300), (127, 128), (200, 201), (100, 400), (4000, 4096)]:
        assert G._attention(start, end) == brute(start, end)
    full = dataclasses.replace(G, windows=())
    assert G.kv_bytes_per_token == full.kv_bytes_per_token == 2 * 24 * 8 * 64 * 2
    assert G.step_seconds([(8191, 8192)] * 8) < full.step_seconds([(8191, 8192)] * 8)
    assert G.step_seconds([(0, 64)]) == full.step_seconds([(0, 64)])  # below the window: the same model
    bs, L = 16, 32768
    per_block = G.kv_bytes_per_layer_token * bs
    assert G.kv_bytes_held(L, bs, grouped=False) == 24 * (L // bs) * per_block
    assert G.kv_bytes_held(L, bs) == 12 * (L // bs) * per_block + 12 * 8 * per_block  # blocks of [L - 127, L)
    assert G.weight_bytes == 20_900_000_000 * 2


def test_kv_bytes_held_counts_the_blocks_the_group_core_holds():
    from fastkv.config import KVLayout
    from fastkv.deploy.cost_model import GPT_OSS_20B_H100 as G

    for bs in (16, 64):
        layout = KVLayout(G.layers, G.kv_heads, bs, G.head_dim, windows=G.windows)
        for n in (1, 100, 127, 128, 129, 1000, 32768):
            assert G.kv_bytes_held(n, bs) == layout.bytes_per_request(n)

"""The whole system with the tiny Paddle decoder: engine, workers and transfer processes.

Greedy outputs must be token-identical to the model run alone (one request at a time, a
cache big enough for everything), at tp=1 and tp=2, with no memory pressure and under
pressure in every preemption mode. The engine checks the scheduler's and the cache's
integrity after every step (``launch.engine_main``).
"""
from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.engine.runners.tiny_decoder import TinyConfig, TinyDecoderRunner
from fastkv.run import RunSpec
from fastkv.sched.output import SeqWork, StepPlan
from fastkv.storage.base import HEADER_BYTES as VALUE_HEADER_BYTES
from tests.e2e.launch import Run, new_run_id

CFG = dict(vocab=512, hidden=64, intermediate=128, max_positions=256, seed=11)
MAX_NEW = 10
SYSTEM = [7, 300, 41, 99, 5, 211, 18, 64]  # a shared system prompt: prefix-cache hits across requests
PROMPTS = {f"q{i}": (SYSTEM if i % 2 else []) + [(i * 37 + j * 13) % 500 for j in range(6 + 2 * i)]
           for i in range(8)}


def layout(tp: int, kv_cache_dtype: str = "float32") -> KVLayout:
    return KVLayout.of(kv_cache_dtype, num_layers=2, kv_heads=4 // tp, block_size=4, head_dim=16, tp_size=tp)


def mla_layout(tp: int) -> KVLayout:
    """One latent of 16 (12 content + 4 RoPE dims) per token and layer, whole on every rank."""
    return KVLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=16, dtype="float32", tp_size=tp, mla=True)


@cache
def reference() -> dict[str, list[int]]:
    """Each prompt alone through the model in this process (tp=1): prefill, then decode."""
    lay = layout(1)
    k = [np.zeros(lay.device_shape(32), np.float32) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(32), np.float32) for _ in range(lay.num_layers)]
    runner = TinyDecoderRunner(lay, 0, 1, k, v, config=TinyConfig(**CFG))
    table = np.arange(32, dtype=np.int32)
    out = {}
    for rid, prompt in PROMPTS.items():
        toks, new, step = list(prompt), list(prompt), 0
        while len(toks) < len(prompt) + MAX_NEW:
            res = runner.step(StepPlan(step, [SeqWork(0, np.array(new), len(toks) - len(new), table, True)]))
            toks.append(res.sampled[0])
            new, step = [res.sampled[0]], step + 1
        out[rid] = toks[len(prompt):]
    return out


def workload() -> list[dict]:
    return [{"id": rid, "arrival_s": 0, "prompt": p, "max_new_tokens": MAX_NEW, "preemption": None}
            for rid, p in PROMPTS.items()]


@cache
def quantized_reference(kv_cache_dtype: str) -> dict[str, list[int]]:
    """Each prompt through the cache-free numpy model (tests/unit) that rounds K and V as the runner writes them."""
    from tests.unit.test_tiny_decoder import reference as dense

    return {rid: dense(p, MAX_NEW, layout(1, kv_cache_dtype), TinyConfig(**CFG))[0] for rid, p in PROMPTS.items()}


@cache
def mla_reference() -> dict[str, list[int]]:
    """Each prompt through the cache-free numpy MLA model (tests/unit)."""
    from tests.unit.test_tiny_mla import mla_reference as dense

    return {rid: dense(p, MAX_NEW, mla_layout(1), TinyConfig(**CFG))[0] for rid, p in PROMPTS.items()}


def run_tiny(tp: int, mode: str, out_dir, storage_url: str = "", async_scheduling: bool = True,
             kv_cache_dtype: str = "float32", lay: KVLayout | None = None) -> tuple[dict, dict]:
    pressure = mode != "none"
    # Storage mode: a small host tier, so that host copies are evicted and resumes LOAD from storage.
    spec = RunSpec(new_run_id(), lay or layout(tp, kv_cache_dtype), num_device_blocks=20 if pressure else 128,
                   num_host_blocks=8 if storage_url else 48,
                   storage_url=storage_url, runner="tiny", runner_options={"config": CFG},
                   scheduler={"preemption": mode if pressure else "recompute", "max_num_batched_tokens": 48},
                   heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256, nslots=256,
                   async_scheduling=async_scheduling)
    with Run(spec, workload()) as run:
        assert run.wait(120) == 0, "engine failed (see its stderr above)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), f"process exit codes {codes}"
    return results, summary


MODES = ["none", "recompute", "offload", "storage-lmdb", "storage-redis"]


@pytest.mark.slow
@pytest.mark.parametrize("async_scheduling", [True, False], ids=["async", "sync"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_outputs_identical_in_every_mode(tp, mode, async_scheduling, tmp_path, request):
    url = ""
    if mode == "storage-lmdb":
        url = f"lmdb://{tmp_path}/lmdb?max_bytes=64M"
    elif mode == "storage-redis":
        url = request.getfixturevalue("redis_url") + f"?prefix={new_run_id()}"
    results, summary = run_tiny(tp, mode.split("-")[0], tmp_path / "out", url, async_scheduling)
    want = reference()
    assert sorted(results) == sorted(want)
    for rid, row in results.items():
        assert row["finish"] == "length" and row["output"] == want[rid], f"{rid}: {row} != {want[rid]}"
    pre = summary["preemptions"]
    assert summary["requests"] == len(PROMPTS) and summary["generated_tokens"] == len(PROMPTS) * MAX_NEW
    if mode == "none":
        assert sum(pre.values()) == 0 and summary["recomputed_tokens"] == 0
    else:
        assert pre[mode.split("-")[0]] > 0, f"no {mode} preemption under pressure: {summary}"
    if mode == "offload":  # (a LOADING request may still be preempted by recompute: it has nothing to copy)
        assert summary["recomputed_tokens"] == 0
        assert all(row["recomputed_tokens"] == 0 for row in results.values())
    if mode.startswith("storage"):
        # A victim comes back by LOAD once its STOREs are done and the 8-block host tier has let
        # its copies go; re-admitted sooner (a slow store, a loaded machine: CI saw it with Redis),
        # it hits its host copies instead. Timing picks which, not correctness: the outputs above
        # are checked either way, and the restart tests in test_storage_pool.py always LOAD.
        tasks, hits = summary["copy_tasks"], summary["hit_ratio"]
        assert tasks.get("store", 0) > 0, f"nothing written to storage: {summary}"
        assert hits["storage"] + hits["host"] > 0, f"no victim came back from storage or its host copies: {summary}"
        # Storage serves only what a LOAD brought; a LOAD may also land for nobody, when its
        # request is preempted again while loading (CI saw it): the next admission finds those
        # blocks on the host (test_coalesced_loads.py pins that accounting).
        assert hits["storage"] == 0 or tasks.get("load", 0) > 0, summary
        assert summary["storage_errors"] == 0 and summary["recomputed_because_storage"] == 0, summary
    if mode == "recompute" and not async_scheduling:
        # (with async scheduling a victim is never one in the step in flight: which requests are
        # preempted, and where in their blocks, depends on timing, and may recompute nothing)
        assert summary["recomputed_tokens"] > 0


def _assert_the_reference_with_preemptions(results, summary, want, mode):
    """Every request's tokens are the reference's, and the mode preempted (an offload without recompute)."""
    assert sorted(results) == sorted(want)
    for rid, row in results.items():
        assert row["finish"] == "length" and row["output"] == want[rid], f"{rid}: {row} != {want[rid]}"
    pre, tasks = summary["preemptions"], summary["copy_tasks"]
    assert sum(pre.values()) > 0 and (mode == "auto" or pre[mode] > 0), f"no {mode} preemption: {summary}"
    if mode == "offload":
        assert summary["recomputed_tokens"] == 0 and tasks.get("swap_in", 0) > 0, summary


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "offload", "storage", "auto"])
@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e4m3", "int8"])
def test_quantized_kv_equals_the_cache_free_reference(kv_cache_dtype, mode, tp, tmp_path):
    """Quantized K and V with their scales through every tier: the tokens are those of the
    cache-free model that rounds K and V the same way."""
    url = f"lmdb://{tmp_path}/lmdb?max_bytes=64M" if mode in ("storage", "auto") else ""
    results, summary = run_tiny(tp, mode, tmp_path / "out", url, kv_cache_dtype=kv_cache_dtype)
    want = quantized_reference(kv_cache_dtype)
    _assert_the_reference_with_preemptions(results, summary, want, mode)
    if mode == "storage":
        assert summary["copy_tasks"].get("store", 0) > 0 and summary["storage_errors"] == 0, summary
    assert summary["host_checksum_mismatches"] == 0, summary
    assert summary["kv_cache_dtype"] == kv_cache_dtype
    assert summary["kv_bytes_per_token"] == 2 * 2 * (4 // tp) * (16 + 4)  # layers x K,V x heads x (values + scale)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["recompute", "offload", "storage", "auto"])
def test_mla_latent_equals_the_cache_free_reference(mode, tp, tmp_path):
    """MLA's latent cache through every tier: the tokens are the cache-free MLA model's. With
    storage, the tier holds each latent block once, whatever tp (rank 0 writes it)."""
    path = tmp_path / "lmdb"
    url = f"lmdb://{path}?max_bytes=64M" if mode in ("storage", "auto") else ""
    results, summary = run_tiny(tp, mode, tmp_path / "out", url, lay=mla_layout(tp))
    want = mla_reference()
    _assert_the_reference_with_preemptions(results, summary, want, mode)
    assert summary["host_checksum_mismatches"] == 0 and summary["storage_errors"] == 0, summary
    assert summary["kv_bytes_per_token"] == 2 * 16 * 4  # layers x latent x float32, at any tp
    assert summary["kv_layout"] == "mla"
    if mode == "storage":
        assert summary["copy_tasks"].get("store", 0) > 0, summary
        stored_bytes, families = lmdb_contents(path)
        assert families > 0
        # bytes stored per token: one value (header + one host block) per block, at tp 1 and tp 2
        per_token = (stored_bytes - families * VALUE_HEADER_BYTES) / (families * mla_layout(tp).block_size)
        assert per_token == mla_layout(tp).bytes_per_token == 2 * 16 * 4


def lmdb_contents(path) -> tuple[int, int]:
    """(value bytes, key families) the LMDB store at ``path`` holds."""
    from fastkv.storage.lmdb_store import LMDBStore

    with LMDBStore(str(path), bytes(32), max_bytes=64 << 20) as store:
        store.check_integrity()
        return store.used_bytes(), len(store.families_lru())


@pytest.mark.slow
def test_runner_error_fails_the_run_loudly(tmp_path, capfd):
    """A runner exception on every rank reaches the engine as OutputMsg.error: exit 1, reason on stderr."""
    cfg = dict(CFG, max_positions=12)  # the longer prompts do not fit
    spec = RunSpec(new_run_id(), layout(2), num_device_blocks=64, num_host_blocks=8, runner="tiny",
                   runner_options={"config": cfg}, heartbeat_s=0.2, out_dir=str(tmp_path), slot_size=256, nslots=256)
    with Run(spec, workload()) as run:
        assert run.wait(120) == 1
        codes = run.close()
    assert codes["worker0"] == codes["worker1"] == 0, f"workers should outlive a failed step: {codes}"
    err = capfd.readouterr().err
    assert "fastkv engine: step" in err and "worker0 step" in err and "worker1 step" in err, err[-3000:]
    assert "max_positions 12" in err

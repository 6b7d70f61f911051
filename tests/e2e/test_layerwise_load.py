"""Layer-wise loading end to end: with ``layerwise_load`` on, a step starts once the host -> device
copies it needs are verified and acked, and each layer waits for its own KV (fastkv.ipc.landed);
off, it waits for the whole copy. The outputs must be the same tokens either way, equal to each
runner's reference, at tp 1 and 2, in every preemption mode, and the on runs must really have
copied layer by layer."""
from __future__ import annotations

import pytest

from fastkv.run import RunSpec
from tests.e2e import test_engine_paddleformers as pf
from tests.e2e import test_engine_synthetic as syn
from tests.e2e import test_engine_tiny as tiny
from tests.e2e.launch import Run, new_run_id
from tests.optional import require_paddle

require_paddle()


def _layered(summary: dict, on: bool) -> None:
    lw = summary["layerwise_load"]
    assert lw["on"] is on, lw
    swap_ins = summary["copy_tasks"].get("swap_in", 0)
    if on:
        assert lw["layered_swap_ins"] == swap_ins, f"every swap-in goes layer by layer: {summary}"
    else:
        assert lw["layered_swap_ins"] == 0 and lw["plans_on_landing_copies"] == 0, lw


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["offload", "storage", "recompute"])
def test_synthetic_outputs_identical_with_layerwise_load_on_and_off(tp, mode, tmp_path):
    wl = syn.workload(16, 12, [mode])
    outputs, swap_ins = {}, 0
    for on in (True, False):
        url = f"lmdb://{tmp_path}/lmdb-{on}?max_bytes=64M" if mode == "storage" else ""
        results, summary = syn.run_once(tmp_path, f"{mode}-{on}", url, wl, tp=tp, num_host_blocks=64,
                                        layerwise_load=on)  # run_once checks the synthetic reference
        _layered(summary, on)
        outputs[on] = {rid: row["output"] for rid, row in results.items()}
        if on:
            swap_ins = summary["layerwise_load"]["layered_swap_ins"]
    assert outputs[True] == outputs[False]
    assert swap_ins > 0, "no swap-in to load layer by layer: the test shows nothing"


def _tiny(tp: int, mode: str, out_dir, url: str, on: bool) -> tuple[dict, dict]:
    spec = RunSpec(new_run_id(), tiny.layout(tp), num_device_blocks=20, num_host_blocks=8 if url else 48,
                   storage_url=url, runner="tiny", runner_options={"config": tiny.CFG},
                   scheduler={"preemption": mode, "max_num_batched_tokens": 48},
                   heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256, nslots=256, layerwise_load=on)
    with Run(spec, tiny.workload()) as run:
        assert run.wait(120) == 0, "engine failed (see its stderr above)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), f"process exit codes {codes}"
    return results, summary


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("mode", ["offload", "storage", "recompute"])
def test_tiny_decoder_outputs_identical_with_layerwise_load_on_and_off(tp, mode, tmp_path):
    want = tiny.reference()
    for on in (True, False):
        url = f"lmdb://{tmp_path}/lmdb-{on}?max_bytes=64M" if mode == "storage" else ""
        results, summary = _tiny(tp, mode, tmp_path / f"out-{on}", url, on)
        for rid, row in results.items():
            assert row["finish"] == "length" and row["output"] == want[rid], f"{rid} (layerwise {on}): {row}"
        assert summary["preemptions"][mode] > 0, f"no {mode} preemption: {summary}"
        _layered(summary, on)


@pytest.mark.slow
@pytest.mark.parametrize(("tp", "mode"), [(1, "offload"), (1, "recompute"), (2, "storage"), (2, "offload")])
def test_paddleformers_outputs_identical_with_layerwise_load_on_and_off(tp, mode, tmp_path):
    url = f"lmdb://{tmp_path}/store?max_bytes=64M" if mode == "storage" else ""
    for on in (True, False):
        results, summary = pf.serve(pf.spec("llama", tp, tmp_path / f"out-{on}", mode,
                                            url.replace("store", f"store-{on}"), layerwise_load=on))
        assert not pf.mismatches("llama", results), f"layerwise {on}"
        pf.check_preempted(summary, mode)
        _layered(summary, on)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_a_deployment_worker_with_and_without_wait_layer_serves_the_same_tokens(tp, tmp_path):
    """The embedding example's toy worker on a tight device tier (offloads, restores by swap-in):
    with ``WorkerPort(layerwise=True)`` it calls ``wait_layer`` before its layer; without, its
    port waits for the whole copies in ``plans()``. Both equal the toy's reference."""
    import numpy as np

    from fastkv.config import KVLayout
    from tests.e2e.embed_example import reference, serve

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, 1000, int(n)).tolist() for n in rng.integers(6, 14, 6)]
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32", tp_size=tp)
    want = {f"req-{i}": reference(p, 12, i, 0.7) for i, p in enumerate(prompts)}
    for layerwise in (True, False):
        spec = RunSpec(new_run_id(), layout, 12, 64, out_dir=str(tmp_path / f"out-{layerwise}"), heartbeat_s=0.2,
                       dead_after_s=5.0)
        got = serve(spec, prompts, 12, layerwise=layerwise)
        assert got["preemptions"] > 0, "no preemption: nothing was swapped back in"
        assert got["outputs"] == want, f"layerwise {layerwise}"

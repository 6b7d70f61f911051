"""A sliding-window hybrid layout through the whole system (engine, workers, transfer processes):
one device pool and block table per KV cache group, the sliding layers' tensors smaller than the
full ones. The synthetic runner verifies every byte each group must hold before every step and
samples from each group's window through its own table, so outputs equal the reference only if
every group's table is right; the summary's per-group counts show the sliding group's bound.
"""
from __future__ import annotations

import pytest

from fastkv.config import KVLayout, cdiv
from fastkv.engine.runners.synthetic import reference_output
from fastkv.run import RunSpec
from tests.e2e.launch import Run, new_run_id

VOCAB = 512
WINDOW = 6
LAYOUT = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=16, dtype="bfloat16", windows=(WINDOW, 0) * 2)
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3]


def workload(n: int, max_new: int) -> list[dict]:
    return [{"id": f"g{i}", "arrival_s": 0, "max_new_tokens": max_new, "preemption": None,
             "prompt": (SYSTEM if i % 2 else []) + [(i * 29 + j * 7) % 500 for j in range(5 + 3 * (i % 5))]}
            for i in range(n)]


def spec(out_dir, group_blocks, host_blocks=0, preemption="recompute", **kw) -> RunSpec:
    return RunSpec(new_run_id(), LAYOUT, num_device_blocks=max(group_blocks), num_host_blocks=host_blocks,
                   group_blocks=tuple(group_blocks), runner="synthetic",
                   runner_options={"verify": "all", "vocab": VOCAB},
                   scheduler={"max_num_batched_tokens": 16, "preemption": preemption},
                   heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256, nslots=256, **kw)


def _serves_the_reference(s, wl) -> dict:
    """Runs ``wl`` on ``s`` (nothing left in /dev/shm after, host segments included); every output
    equals the windowed reference. The run's summary."""
    with Run(s, wl) as run:
        assert run.wait(120) == 0, "engine failed: a KV mismatch or a worker error (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()  # asserts nothing is left in /dev/shm
    assert all(c == 0 for c in codes.values()), codes
    windows = [g.window for g in LAYOUT.groups]
    for w in wl:
        row = results[w["id"]]
        assert row["finish"] == "length", row
        assert row["output"] == reference_output(w["prompt"], w["max_new_tokens"], VOCAB, "bfloat16",
                                                 windows=windows), row
    return summary


@pytest.mark.parametrize("overlap", [True, False])
def test_a_hybrid_serves_the_reference_with_a_bounded_sliding_group_under_preemption(overlap, tmp_path):
    """With async scheduling a step is planned while the one before runs: its tables follow
    from where that step ends (``GroupedManager.step_table``)."""
    wl = workload(8, 10)
    # the sliding group's 12 blocks, the full group's 14
    s = spec(tmp_path / "out", [12, 14], async_scheduling=overlap)
    summary = _serves_the_reference(s, wl)
    assert summary["preemptions"]["recompute"] > 0 and summary["recomputed_tokens"] > 0, summary
    assert summary["verified"]["kv_blocks_verified"] > 0 and summary["verified"]["kv_mismatches"] == 0
    steps = summary["async_scheduling"]
    assert steps["on"] is overlap and (steps["overlapped_steps"] > 0) is overlap, steps
    sliding, full = summary["kv_groups"]
    assert sliding["window"] == WINDOW and full["window"] == 0
    assert (sliding["blocks"], full["blocks"]) == (12, 14)
    assert 0 < sliding["max_held_per_request"] <= cdiv(WINDOW, LAYOUT.block_size) + 1, sliding
    assert full["max_held_per_request"] > cdiv(WINDOW, LAYOUT.block_size) + 1, full
    assert sliding["hit_blocks"] > 0 and full["hit_blocks"] > 0, summary["kv_groups"]


@pytest.mark.parametrize("overlap", [True, False])
def test_a_hybrid_preempts_by_offload_per_group_and_restores_exactly(overlap, tmp_path):
    """Each group offloads to its own host segment what its table holds (a sliding group its
    window's tail, the full group every block), and a restore brings exactly that back: the
    synthetic runner verifies every byte each group reads after the restore."""
    wl = workload(8, 10)
    bound = cdiv(WINDOW, LAYOUT.block_size) + 1
    s = spec(tmp_path / "out", [12, 14], host_blocks=40, preemption="offload", async_scheduling=overlap)
    assert s.host_group_blocks() == (34, 40)
    summary = _serves_the_reference(s, wl)
    assert summary["preemptions"]["offload"] > 0 and summary["preemptions"]["recompute"] == 0, summary["preemptions"]
    assert summary["verified"]["kv_blocks_verified"] > 0 and summary["verified"]["kv_mismatches"] == 0
    sliding, full = summary["kv_groups"]
    assert (sliding["host_blocks"], full["host_blocks"]) == (34, 40)
    assert sliding["offloaded_blocks"] > 0 and full["offloaded_blocks"] > 0, summary["kv_groups"]
    assert 0 < sliding["max_offloaded_per_request"] <= bound < full["max_offloaded_per_request"], summary["kv_groups"]


@pytest.mark.parametrize(("kw", "flag"), [({"storage_url": "lmdb:///tmp/x"}, "--storage"),
                                          ({"role": "prefill"}, "--role"),
                                          ({"update_weights_at": ("2:v2",)}, "--update-weights-at"),
                                          ({"kv_events": {"endpoint": "tcp://*:5557"}},
                                           r"--kv-events-schema llm-d \(its events cannot name a block's KV cache "
                                           r"group: use vllm\)")])
def test_what_a_hybrid_does_not_run_with_yet_is_refused_by_its_flag(kw, flag, tmp_path):
    base = dict(num_device_blocks=8, num_host_blocks=0, runner="synthetic", out_dir=str(tmp_path))
    with pytest.raises(ValueError, match=f"^{flag}: not supported for a sliding-window hybrid layout yet "
                                         r"\(--kv-cache-groups off caches every layer in full\)$"):
        RunSpec(new_run_id(), LAYOUT, **{**base, **kw})
    RunSpec(new_run_id(), KVLayout(4, 2, 4, 16), **{**base, **kw})  # the all-full layout runs with it
    # KV events in the schema that names a block's group
    RunSpec(new_run_id(), LAYOUT, **{**base, "kv_events": {"endpoint": "tcp://*:5557", "schema": "vllm"}})

"""Weight updates across processes: the engine, workers and transfer processes of a
real run switch weights mid-run under offload pressure.

Every request whose output was sampled entirely under the new weights must be token-identical
to the model run alone with those weights; the ones caught by the update are preempted and
re-prefilled, so they carry both versions. The engine checks the scheduler's and the cache's
integrity after every step (``launch.engine_main``); ``Run.close`` asserts nothing leaked.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from fastkv.engine.runners.tiny_decoder import TinyConfig, TinyDecoderRunner
from fastkv.run import RunSpec
from fastkv.sched.output import SeqWork, StepPlan
from tests.e2e.launch import Run, new_run_id
from tests.e2e.test_engine_tiny import CFG, MAX_NEW, SYSTEM, layout

PROMPTS = {f"w{i:02d}": (SYSTEM if i % 2 else []) + [(i * 41 + j * 11) % 500 for j in range(5 + i % 7)]
           for i in range(20)}


@cache
def reference(version: str) -> dict[str, list[int]]:
    """Each prompt alone through the tiny model with ``version``'s weights (tp=1)."""
    lay = layout(1)
    k = [np.zeros(lay.device_shape(32), np.float32) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(32), np.float32) for _ in range(lay.num_layers)]
    runner = TinyDecoderRunner(lay, 0, 1, k, v, config=TinyConfig(**CFG), weights_version=version)
    table = np.arange(32, dtype=np.int32)
    out = {}
    for rid, prompt in PROMPTS.items():
        toks, new = list(prompt), list(prompt)
        while len(toks) < len(prompt) + MAX_NEW:
            res = runner.step(StepPlan(1, [SeqWork(0, np.array(new), len(toks) - len(new), table, True)]))
            toks.append(res.sampled[0])
            new = [res.sampled[0]]
        out[rid] = toks[len(prompt):]
    return out


def run(tp: int, out_dir, **kw) -> tuple[dict, dict]:
    spec = RunSpec(new_run_id(), layout(tp), num_device_blocks=20, num_host_blocks=48, runner="tiny",
                   runner_options={"config": CFG}, scheduler={"preemption": "offload", "max_num_batched_tokens": 48},
                   heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256, nslots=256, **kw)
    wl = [{"id": rid, "arrival_s": 0, "prompt": p, "max_new_tokens": MAX_NEW, "preemption": None}
          for rid, p in PROMPTS.items()]
    with Run(spec, wl) as r:
        assert r.wait(120) == 0, "engine failed (see its stderr above)"
        results, summary = r.results(), r.summary()
        codes = r.close()
    assert all(c == 0 for c in codes.values()), f"process exit codes {codes}"
    return results, summary


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_update_at_8_serves_v2_exactly_like_a_fresh_v2_run(tp, tmp_path):
    results, summary = run(tp, tmp_path, update_weights_at=("8:v2",), free_memory_on_update=True)
    assert summary["weight_updates"] == 1 and summary["stale_hits"] == 0, summary
    assert summary["requests"] == len(PROMPTS) and sum(summary["preemptions"].values()) > 0, summary
    assert reference("v2") != reference("0"), "the two versions must produce different outputs"
    by_version: dict[str, list[str]] = {}
    for rid, row in results.items():
        assert row["finish"] == "length", row
        by_version.setdefault(row["weights_version"], []).append(rid)
        if row["weights_version"] in ("0", "v2"):
            assert row["output"] == reference(row["weights_version"])[rid], f"{rid}: {row}"
    assert len(by_version.get("0", [])) >= 8 and len(by_version.get("v2", [])) >= 4, by_version
    assert set(by_version) <= {"0", "v2", "0+v2"}, by_version
    # free_memory: both tiers gave memory back while the weights loaded (resident bytes, per rank)
    lay = layout(tp)
    assert summary["released_bytes"]["device"] >= tp * 20 * lay.block_bytes // 2, summary["released_bytes"]
    assert summary["released_bytes"]["host"] >= tp * 4 * lay.block_bytes, summary["released_bytes"]  # pages written

"""Async scheduling through real processes: the same workload with ``async_scheduling`` off
and on gives identical outputs (equal to the synthetic model's reference), in every
preemption mode, at tp 1 and 2, under preemption pressure, with every KV block the workers
read verified by the synthetic runner's oracle."""
from __future__ import annotations

import sys

import pytest

from tests.e2e.test_engine_synthetic import check_outputs, run_once, workload

MODES = ["recompute", "offload", "storage", "auto"]


@pytest.mark.parametrize("tp", [1, 2])
def test_sync_and_async_give_identical_outputs_in_every_mode(tmp_path, tp):
    wl = workload(16, 14, MODES)
    runs = {}
    for mode in ("off", "on"):
        url = f"lmdb://{tmp_path}/lmdb-{mode}?max_bytes=64M"
        # the engine's CPU policy changes nothing but timing: the synchronous run takes the other one
        runs[mode] = run_once(tmp_path, f"async-{mode}", url, wl, tp=tp, async_scheduling=mode == "on",
                              engine_cpu_policy="batch" if mode == "on" else "normal")
    (off, s_off), (on, s_on) = runs["off"], runs["on"]
    assert {k: v["output"] for k, v in off.items()} == {k: v["output"] for k, v in on.items()}
    check_outputs(on, wl)
    for summary in (s_off, s_on):
        assert sum(summary["preemptions"].values()) > 0, f"no preemption under pressure: {summary}"
        assert summary["verified"]["kv_requests_verified"] > 0, summary
    assert not s_off["async_scheduling"]["on"] and s_off["async_scheduling"]["overlapped_steps"] == 0
    assert s_on["async_scheduling"]["on"] and s_on["async_scheduling"]["overlapped_steps"] > 0, s_on
    if sys.platform.startswith("linux"):
        assert (s_off["engine_cpu_policy"], s_on["engine_cpu_policy"]) == ("normal", "batch")


def _stream(tmp_path, name: str, async_on: bool, eos: int | None, prompts) -> tuple[dict, dict, dict]:
    """Run ``prompts`` on an embedded engine (the toy worker of embed_example.py), streaming;
    returns per request the streamed tokens, its result, and the update its last token came in."""
    import uuid

    from fastkv.config import KVLayout
    from fastkv.engine import Engine
    from fastkv.launch import launch
    from fastkv.run import RunSpec
    from tests.e2e.embed_example import WORKER

    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32")
    spec = RunSpec(f"asy{uuid.uuid4().hex[:8]}", layout, 40, 64, out_dir=str(tmp_path / name), heartbeat_s=0.2,
                   async_scheduling=async_on)
    streamed, results, last_update, finished_update = {}, {}, {}, {}
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready()
            for i, p in enumerate(prompts):
                engine.add_request(p, 12, request_id=f"r{i}", eos_token_id=eos)
            n = 0
            while engine.has_work():
                update = engine.step_stream()
                n += 1
                for rid, toks in update.tokens.items():
                    streamed.setdefault(rid, []).extend(toks)
                    last_update[rid] = n
                for res in update.finished:
                    results[res.id] = res
                    finished_update[res.id] = n
            assert engine.overlapped_steps > 0 if async_on else engine.overlapped_steps == 0
        finally:
            engine.close()
    for rid, res in results.items():  # streaming: a request's last token comes in the update listing it finished
        assert streamed[rid] == res.output and last_update[rid] == finished_update[rid], rid
    return streamed, results, finished_update


def test_stop_on_eos_learned_one_step_late_streams_exactly_the_sync_tokens(tmp_path):
    import numpy as np

    from tests.e2e.embed_example import VOCAB

    rng = np.random.default_rng(3)
    prompts = [rng.integers(0, VOCAB, int(k)).tolist() for k in rng.integers(5, 12, 6)]
    free, _, _ = _stream(tmp_path, "probe", False, None, prompts)
    eos = free["r0"][3]  # a token the first request samples: it stops there, others may too
    outs = {}
    for async_on in (False, True):
        streamed, results, _ = _stream(tmp_path, f"eos-{async_on}", async_on, eos, prompts)
        outs[async_on] = {rid: (r.finish, r.output) for rid, r in results.items()}
    assert outs[False] == outs[True]
    assert outs[True]["r0"] == ("stop", free["r0"][:free["r0"].index(eos) + 1])
    for rid, (finish, out) in outs[True].items():  # each cut exactly at its first eos, or run to length
        full = free[rid]
        assert out == (full[:full.index(eos) + 1] if eos in full else full), rid
        assert finish == ("stop" if eos in full else "length"), rid

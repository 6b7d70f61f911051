"""The engine's control API on real worker and transfer processes, driven from this process:
twenty weight updates in a row under load, memory freed during an update, and
reset_prefix_cache with requests in flight. The synthetic runner (verify="all") checks every
KV position of every request before every step: KV lost, or computed under other weights
(a stale hit), fails the step and the test."""
from __future__ import annotations

import pytest

from fastkv.engine import Engine
from fastkv.engine.runners.synthetic import reference_output
from fastkv.sched import RequestState
from fastkv.transfer.tiers import device_tier_name, host_tier_name, resident_bytes
from tests.e2e.launch import Run
from tests.e2e.test_engine_synthetic import SYSTEM, VOCAB, spec, workload


def expected(prompt: list[int], max_new: int, version: str) -> list[int]:
    return reference_output(prompt, max_new, VOCAB, "bfloat16", version)


def attach(s) -> Engine:
    engine = Engine.attach(s, check=True)
    engine.wait_until_ready(120)
    return engine


@pytest.mark.slow
def test_twenty_weight_updates_in_a_row_under_load(tmp_path):
    wl = workload(24, 16, ["offload", "recompute", None])
    s = spec(2, tmp_path / "out", num_device_blocks=24, num_host_blocks=64,
             runner_options={"verify": "all", "vocab": VOCAB},
             scheduler={"max_num_batched_tokens": 48, "preemption": "offload"})
    layout = s.layout
    with Run(s, wl, engine=False) as run:
        engine = attach(s)
        try:
            for w in wl:
                engine.add_request(w["prompt"], w["max_new_tokens"], request_id=w["id"])
            results, versions, low = [], ["0"], []
            while engine.has_work() or len(versions) <= 20:
                for _ in range(3):  # a few steps of load between updates
                    results += engine.step()
                if len(versions) <= 20:
                    free = len(versions) % 2 == 0
                    results += engine.update_weights(f"v{len(versions)}", free_memory=free).finished
                    versions.append(f"v{len(versions)}")
                    if free:  # measured before the next step writes anything
                        low.append(max(resident_bytes(device_tier_name(s.tier_prefix, r)) +
                                       resident_bytes(host_tier_name(s.tier_prefix, r)) for r in range(2)))
            sig = engine.ends.signals
            assert engine.weight_updates == 20 and engine.transfer.pending == 0
            assert sum(sig[f"worker{r}.kv_stale_hits"] + sig[f"worker{r}.kv_mismatches"] for r in range(2)) == 0
            assert sum(sig[f"worker{r}.kv_requests_verified"] for r in range(2)) > 0
            released = [sig[f"{p}{r}.released_bytes"] for p in ("worker", "transfer") for r in range(2)]
        finally:
            engine.close()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    assert sorted(r.id for r in results) == sorted(w["id"] for w in wl)
    assert all(r.finish == "length" for r in results), [r for r in results if r.finish != "length"]
    by_id = {w["id"]: w for w in wl}
    single = [r for r in results if "+" not in r.weights_version]
    for r in single:
        assert r.output == expected(by_id[r.id]["prompt"], 16, r.weights_version), r
    assert any("+" in r.weights_version for r in results), "no update caught a request mid-output"
    # every update with free_memory gave memory back on every rank, and both tiers stayed tiny until the next step
    assert min(released) > 0, released
    tier_bytes = (s.num_device_blocks + s.num_host_blocks) * layout.block_bytes
    assert low and max(low) < tier_bytes // 4, (low, tier_bytes)


@pytest.mark.slow
def test_reset_prefix_cache_with_requests_in_flight(tmp_path):
    s = spec(1, tmp_path / "out", num_device_blocks=48, num_host_blocks=32,
             runner_options={"verify": "all", "vocab": VOCAB},
             scheduler={"max_num_batched_tokens": 48, "preemption": "offload"})
    prefix = SYSTEM * 2  # six full blocks
    with Run(s, [], engine=False) as run:
        engine = attach(s)
        try:
            engine.add_request(prefix + [7], 4, request_id="warm")
            results = engine.run()
            assert engine.cache.match(prefix + [9]).num_blocks == 6  # cached on the device (and host)
            inflight = [engine.add_request([100 + i, 200 + i, 3, 4, 5, 6, 7, 8, 9], 30, request_id=f"run{i}")
                        for i in range(3)]
            while not all(engine.sched.get_request(engine._ids[e]).state is RequestState.RUNNING  # noqa: SLF001
                          and engine.sched.get_request(engine._ids[e]).output_token_ids for e in inflight):
                results += engine.step()
            held = {e: engine.cache.block_table(engine._ids[e]).copy() for e in inflight}  # noqa: SLF001
            assert engine.reset_prefix_cache() >= 6
            assert engine.cache.match(prefix + [9]).num_blocks == 0, "a cached block survived the reset"
            for e in inflight:  # the running requests keep their blocks
                assert (engine.cache.block_table(engine._ids[e]) == held[e]).all()  # noqa: SLF001
            hits = engine.cache.stats.hit_tokens
            engine.add_request(prefix + [11], 4, request_id="after")
            results += engine.step()
            assert engine.cache.stats.hit_tokens == hits, "a request hit the cache right after the reset"
            results += engine.run()
            engine.add_request(prefix + [12], 4, request_id="again")
            results += engine.run()
            assert engine.cache.stats.hit_tokens >= hits + 6 * s.layout.block_size, "the cache did not recover"
            assert sum(engine.ends.signals[c] for c in ("worker0.kv_mismatches", "worker0.kv_stale_hits")) == 0
        finally:
            engine.close()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    by_id = {r.id: r for r in results}
    assert all(r.finish == "length" for r in results) and len(by_id) == 6
    assert by_id["after"].output == expected(prefix + [11], 4, "0")
    for i in range(3):
        assert by_id[f"run{i}"].output == expected([100 + i, 200 + i, 3, 4, 5, 6, 7, 8, 9], 30, "0")

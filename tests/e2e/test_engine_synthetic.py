"""The whole system with the synthetic runner: KV bytes are a function of (token, position,
layer, head, rank), and the runner (verify="all") checks every computed position of every
request on the device before every step. A block that came back from the host or from
storage with one wrong byte fails the step, and the engine fails the run.
"""
from __future__ import annotations

import time

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.engine import Engine
from fastkv.engine.runners.synthetic import reference_output
from fastkv.run import RunSpec
from fastkv.sched import RequestState
from tests.e2e.launch import Run, new_run_id

VOCAB = 512
SYSTEM = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8]


def expected(prompt: list[int], max_new: int) -> list[int]:
    return reference_output(prompt, max_new, VOCAB, "bfloat16")


def workload(n: int, max_new: int, modes: list[str | None]) -> list[dict]:
    return [{"id": f"s{i}", "arrival_s": 0, "max_new_tokens": max_new, "preemption": modes[i % len(modes)],
             "prompt": (SYSTEM if i % 3 else []) + [(i * 29 + j * 7) % 500 for j in range(5 + 3 * (i % 5))]}
            for i in range(n)]


def spec(tp: int, out_dir, **kw) -> RunSpec:
    lay = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=16, dtype="bfloat16", tp_size=tp)
    return RunSpec(new_run_id(), lay, runner="synthetic", heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256,
                   nslots=256, **kw)


def check_outputs(results: dict, wl: list[dict]) -> None:
    assert sorted(results) == sorted(w["id"] for w in wl)
    for w in wl:
        row = results[w["id"]]
        assert row["finish"] == "length" and row["output"] == expected(w["prompt"], w["max_new_tokens"]), row


def run_once(tmp_path, name: str, url: str, wl: list[dict], tp: int = 1, reference: bool = True,
             num_host_blocks: int = 12, **kw) -> tuple[dict, dict]:
    """One run that every worker ends cleanly; ``reference``: outputs equal the synthetic reference."""
    s = spec(tp, tmp_path / name, num_device_blocks=24, num_host_blocks=num_host_blocks, storage_url=url,
             runner_options={"verify": "all", "vocab": VOCAB}, scheduler={"max_num_batched_tokens": 48}, **kw)
    with Run(s, wl) as run:
        assert run.wait(120) == 0, "engine failed: a KV mismatch or a worker error (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    if reference:
        check_outputs(results, wl)
    t = summary["gpu_time"]  # the wall from the first step to the last, split by cause
    assert 0 < summary["gpu_busy"] <= 1 and t["gpu"] > 0, summary
    assert sum(v for k, v in t.items() if k != "wall") == pytest.approx(t["wall"], abs=1e-3), t
    assert t["wall"] <= summary["last_token_s"] <= summary["seconds"], summary
    return results, summary


@pytest.mark.slow
def test_every_block_verified_after_host_and_storage_round_trips(tmp_path):
    """Run A preempts by copy under pressure; run B restarts on A's store. Which mode a preemption
    ends up using (a victim that stalls past its patience, or is LOADING, recomputes), whether a
    storage victim comes back by LOAD or from the host tier, and which lower tier serves a
    prefix all depend on timing: CI once saw no host prefix hit, and 50 local runs saw each of
    offload 0, storage 0 and LOAD 0, and CI later saw every preemption of A recompute (under
    write-through a request waits in LOADING for the write-back of a block it evicted, and a
    LOADING victim recomputes). So A claims copies in aggregate, and the storage round trip
    that must happen is B's: its tiers start empty, and A wrote through. A's host tier holds
    what it writes through (64 blocks): with 6, write-throughs that found no free host block
    were skipped, so A stored 4-45 of the 64 blocks B asks for (CI once saw 6, none of them a
    loadable prefix, and no LOAD); with 64, 57 of 64 in every run tried. The per-mode paths are
    checked deterministically in tests/unit/sched."""
    wl = workload(16, 12, ["offload", "storage"])
    url = f"lmdb://{tmp_path}/lmdb?max_bytes=64M"
    _, a = run_once(tmp_path, "a", url, wl, tp=2, num_host_blocks=64)
    pre, tasks = a["preemptions"], a["copy_tasks"]
    assert sum(pre.values()) > 0, f"no preemption under pressure: {a}"
    assert tasks.get("swap_out", 0) > 0 and tasks.get("swap_in", 0) > 0, f"no host round trip: {a}"
    assert tasks.get("store", 0) > 0, a
    _, b = run_once(tmp_path, "b", url, wl, tp=2, num_host_blocks=6)
    assert b["copy_tasks"].get("load", 0) > 0 and b["hit_ratio"]["storage"] > 0, f"no storage round trip: {b}"
    assert b["corrupt_values"] == 0, b


@pytest.mark.slow
def test_transfer_process_killed_mid_run(tmp_path):
    """SIGKILL transfer[1] while requests are being offloaded: its tasks fail (their requests
    recompute), the restarted process takes over, every request finishes with the right tokens."""
    wl = workload(16, 24, ["offload"])
    s = spec(2, tmp_path / "out", num_device_blocks=24, num_host_blocks=6,
             runner_options={"verify": "all", "vocab": VOCAB, "step_us": 15000.0},
             scheduler={"max_num_batched_tokens": 48, "preemption": "offload"})
    with Run(s, wl) as run:
        deadline = time.monotonic() + 60
        while run.sig["engine.finished"] < 1 and run.procs["engine"].is_alive():
            assert time.monotonic() < deadline, "no request finished within 60 s"
            time.sleep(0.01)
        assert run.sig["engine.finished"] < len(wl), "the run ended before the kill: make it longer"
        run.kill("transfer1")
        time.sleep(0.3)  # the supervisor notices by heartbeat; the engine by the dead ring peer
        run.restart_transfer(1)
        run.wait_ready(["transfer1"])
        assert run.procs["engine"].is_alive(), "the run ended before the new transfer process was up"
        assert run.wait(120) == 0, "engine failed after the transfer process was killed"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert codes["engine"] == 0 and codes["worker0"] == codes["worker1"] == codes["transfer0"] == 0, codes
    assert codes["transfer1"] == 0, f"the restarted transfer process failed: {codes}"
    check_outputs(results, wl)
    assert summary["preemptions"]["offload"] > 0, summary


def corrupting_transfer_main(spec_json: str, rank: int) -> int:
    """The transfer process, but host memory goes bad: one bit of every block it swaps out
    flips right after the copy (and its checksum) landed."""
    from fastkv.transfer import process
    from fastkv.transfer.executor import TaskExecutor

    swap = TaskExecutor._swap

    def swap_and_flip(self, plan):
        done = swap(self, plan)
        if plan.kind is CopyKind.SWAP_OUT:
            for b in plan.dst.tolist():
                self.host.array[b].view(np.uint8).reshape(-1)[100] ^= 0x04
        return done

    TaskExecutor._swap = swap_and_flip
    return process.main(spec_json, rank)


@pytest.mark.slow
@pytest.mark.parametrize("checksums", [True, False])
def test_flipped_host_bytes_are_recomputed_never_served(tmp_path, checksums):
    """Every block swapped out to the host tier is corrupted there. With host checksums every
    restore is refused and recomputed: the run finishes with the right tokens and counts the
    mismatches. Without them the runner's verification meets the bad KV and the run fails."""
    wl = workload(8, 12, ["offload"])
    s = spec(1, tmp_path / "out", num_device_blocks=16, num_host_blocks=32, host_checksums=checksums,
             runner_options={"verify": "resumed", "vocab": VOCAB},
             scheduler={"max_num_batched_tokens": 48, "preemption": "offload"})
    with Run(s, wl, transfer="tests.e2e.test_engine_synthetic:corrupting_transfer_main") as run:
        rc = run.wait(120)
        if not checksums:
            assert rc != 0, "corrupt KV was served without anyone noticing"
            return
        assert rc == 0, "engine failed: corrupt host KV reached the runner (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    check_outputs(results, wl)
    assert summary["preemptions"]["offload"] > 0, summary
    assert summary["host_checksum_mismatches"] > 0 and summary["recomputed_tokens"] > 0, summary
    assert summary["verified"]["kv_mismatches"] == 0 and summary["verified"]["kv_positions_read"] > 0, summary


def test_a_storage_tier_that_fails_mid_run_is_counted_and_recomputed(tmp_path):
    """Nothing listens at the storage URL (as if the server died after the start-up check):
    every STORE fails, the requests recompute with the right tokens, and the summary counts it."""
    wl = workload(8, 10, ["storage"])
    # a host tier that holds every block: with 6, slow copies on a loaded machine pinned all of
    # it, every offload found no room and preempted by recompute instead (no storage preemption)
    s = spec(1, tmp_path / "out", num_device_blocks=12, num_host_blocks=32, storage_url="redis://127.0.0.1:1?timeout=0.2",
             runner_options={"verify": "resumed", "vocab": VOCAB}, scheduler={"max_num_batched_tokens": 48})
    with Run(s, wl) as run:
        assert run.wait(120) == 0, "engine failed (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    check_outputs(results, wl)
    assert summary["preemptions"]["storage"] > 0 and summary["storage_errors"] > 0, summary
    assert summary["hit_ratio"]["storage"] == 0 and summary["corrupt_values"] == 0, summary


@pytest.mark.slow
def test_engine_abort_of_a_running_and_an_offloaded_request(tmp_path):
    """Engine.abort, in this process, on real worker and transfer processes: one request
    while it runs (tokens sampled, blocks on the device) and one while it is OFFLOADED (its
    KV on the host). Both finish "aborted" with a correct prefix of their tokens, the others
    finish with every token right, and no block or copy is left behind."""
    wl = workload(12, 24, ["offload"])
    s = spec(1, tmp_path / "out", num_device_blocks=24, num_host_blocks=64,
             runner_options={"verify": "all", "vocab": VOCAB},
             scheduler={"max_num_batched_tokens": 48, "preemption": "offload"})
    with Run(s, wl, engine=False) as run:
        engine = Engine.attach(s, check=True)
        try:
            engine.wait_until_ready(120)
            for w in wl:
                engine.add_request(w["prompt"], w["max_new_tokens"], request_id=w["id"])
            states = lambda: {ext: engine.sched.get_request(rid) for ext, rid in engine._ids.items()}  # noqa: SLF001
            aborted: dict[RequestState, str] = {}
            results = []
            while engine.has_work():
                for want in (RequestState.RUNNING, RequestState.OFFLOADED):
                    ext = next((e for e, q in states().items() if q is not None and q.state is want
                                and q.output_token_ids), None)
                    if want not in aborted and ext is not None:
                        assert engine.abort(ext)
                        aborted[want] = ext
                results += engine.step()
            assert set(aborted) == {RequestState.RUNNING, RequestState.OFFLOADED}, \
                f"never saw both states to abort in: aborted {aborted}"
            assert not engine.abort(aborted[RequestState.RUNNING]), "aborting a finished request"
            cache = engine.cache
            assert cache.request_ids() == [] and engine.transfer.pending == 0 and not engine.sched.counts()["running"]
            assert cache.device.num_available == s.num_device_blocks and cache.host.num_available == s.num_host_blocks
        finally:
            engine.close()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    by_id = {r.id: r for r in results}
    assert sorted(by_id) == sorted(w["id"] for w in wl)
    for w in wl:
        r, want = by_id[w["id"]], expected(w["prompt"], w["max_new_tokens"])
        if w["id"] in aborted.values():
            assert r.finish == "aborted" and 0 < len(r.output) < len(want) and r.output == want[:len(r.output)], r
        else:
            assert r.finish == "length" and r.output == want, r
    assert by_id[aborted[RequestState.OFFLOADED]].preemptions >= 1

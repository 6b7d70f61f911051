"""Prefill -> decode handoff through one shared store (``--role``): a prefill engine computes
each prompt and exports its KV; a decode engine takes the requests, loads their KV and decodes.
Its outputs equal a single engine's (the synthetic runner's next token hashes the KV it reads,
so a wrong block changes them), with no prompt token recomputed, and under pressure it refuses
a request with a reason rather than preempt its running ones for it. The two runs go together:
the decode run follows the prefill run's handoff file as it is written."""
from __future__ import annotations

import time
from pathlib import Path

import pytest

from fastkv.cli import report
from fastkv.run import handoff_sem
from tests.e2e.launch import Run, new_run_id
from tests.e2e.test_engine_synthetic import VOCAB, check_outputs, spec, workload


def role_spec(tmp_path, name, url, **kw):
    return spec(1, tmp_path / name, num_device_blocks=24, num_host_blocks=24, storage_url=url,
                runner_options={"verify": "all", "vocab": VOCAB, **kw.pop("runner", {})},
                scheduler={"max_num_batched_tokens": 48}, **kw)


def finish(run: Run, timeout: float = 120) -> tuple[dict, dict]:
    assert run.wait(timeout) == 0, "engine failed: a KV mismatch or a worker error (see stderr)"
    results, summary = run.results(), run.summary()
    codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    return results, summary


def sem_left(handoff: Path) -> bool:
    return Path("/dev/shm", "sem." + handoff_sem(handoff).lstrip("/")).exists()


def check_decode(results, pre, dec, wl, all_at_once: bool = True):
    """``all_at_once``: the decode run found every request announced when it started, more than
    its 24 device blocks hold, so it must have refused some; a decode run started beside the
    prefill run takes them as they come, and whether they ever outgrow it depends on the
    machine's speed."""
    check_outputs(results, wl)  # the single-engine reference outputs
    assert pre["handoff"]["requests"] == len(wl) and pre["handoff"]["failed"] == 0, pre["handoff"]
    h = dec["handoff"]
    print("prefill", pre["handoff"], "decode", h)
    assert h["requests"] == len(wl) and h["recomputed_prompt_tokens"] == 0 and h["bytes"] > 0, h
    assert all(r["recomputed_tokens"] == 0 for r in results.values())
    assert dec["verified"]["kv_mismatches"] == 0
    # 24 device blocks for 10 requests: some had to wait, each refusal named with its reason
    assert h["refused"] == len(h["refusals"]) and (h["refused"] > 0 or not all_at_once), h
    assert all("NO_ROOM" in why or "TOO_MANY_SEQS" in why for why in h["refusals"].values()), h
    assert sum(dec["preemptions"].values()) == 0, dec["preemptions"]  # it refused instead


def test_decode_engine_serves_a_finished_prefill_runs_prompts_token_identically(tmp_path):
    wl = workload(10, 8, [None])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    handoff = tmp_path / "pre" / "handoff.jsonl"
    with Run(role_spec(tmp_path, "pre", url, role="prefill"), wl) as run:
        _, pre = finish(run)
    with Run(role_spec(tmp_path, "dec", url, role="decode", handoff=str(handoff)), wl) as run:
        results, dec = finish(run)
    check_decode(results, pre, dec, wl)
    assert not sem_left(handoff)
    # the decode run's timeline is sampled as any run's: a point per step that finished requests
    tl = dec["timeline"]
    assert len(tl) > 3 and tl[-1][1] == len(wl) and tl[-1][2] == dec["generated_tokens"], tl
    assert [row[2] for row in tl] == sorted(row[2] for row in tl)
    table = report.table(report.build(dec, list(results.values())))
    assert "storage lookups" not in table and f"{dec['storage_lookup']['blocks_loaded']} blocks" in table, table
    assert "(the blocks the handoff named: no lookups)" in table


@pytest.fixture(params=["lmdb", "redis", pytest.param("mooncake", marks=pytest.mark.mooncake)])
def store_url(request, tmp_path):
    """One store for both runs: an LMDB directory, or a Redis or Mooncake pool (a fresh key
    prefix on the module's server or pool)."""
    if request.param == "lmdb":
        return f"lmdb://{tmp_path}/store?max_bytes=64M"
    if request.param == "mooncake":
        return request.getfixturevalue("mooncake_url") + f"&prefix={new_run_id()}"
    return request.getfixturevalue("redis_url") + f"?prefix={new_run_id()}"


def test_prefill_and_decode_runs_started_together(tmp_path, store_url):
    """The decode run starts first, before the handoff file exists, and takes each request
    as the prefill run announces it."""
    wl = workload(10, 8, [None])
    url = store_url
    handoff = tmp_path / "pre" / "handoff.jsonl"
    with Run(role_spec(tmp_path, "dec", url, role="decode", handoff=str(handoff)), wl) as dec_run:
        dec_run.wait_ready(["engine"])
        assert not handoff.exists()
        with Run(role_spec(tmp_path, "pre", url, role="prefill", runner={"step_us": 20000.0}), wl) as pre_run:
            _, pre = finish(pre_run)
        results, dec = finish(dec_run)
    check_decode(results, pre, dec, wl, all_at_once=False)
    assert not sem_left(handoff)


def test_a_prefill_run_that_dies_ends_the_decode_run_with_one_line(tmp_path):
    wl = workload(10, 8, [None])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    handoff = tmp_path / "pre" / "handoff.jsonl"
    with Run(role_spec(tmp_path, "pre", url, role="prefill", runner={"step_us": 200000.0}), wl) as pre_run, \
            Run(role_spec(tmp_path, "dec", url, role="decode", handoff=str(handoff)), wl) as dec_run:
        deadline = time.monotonic() + 60
        while not handoff.exists() and time.monotonic() < deadline:  # test code: polls
            time.sleep(0.05)
        pre_run.kill("engine")
        assert dec_run.wait(60) == 1
        status = dec_run.summary()["status"]
    assert status.startswith("failed: the prefill run (engine pid ") and "died before ending" in status, status
    assert "\n" not in status
    assert not sem_left(handoff)


def test_a_bad_line_in_the_handoff_file_ends_the_decode_run_naming_it(tmp_path):
    """A line that is no handoff record (a file edited by hand, another file's lines): the decode
    run fails with one line naming file:line, not a traceback."""
    wl = workload(4, 8, [None])
    handoff = tmp_path / "handoff.jsonl"
    handoff.write_text('{"header": {"pid": 1, "started": 0}}\n{"id": "s0", "ok": true}\nnot json\n')
    with Run(role_spec(tmp_path, "dec", f"lmdb://{tmp_path}/store?max_bytes=64M", role="decode",
                       handoff=str(handoff)), wl) as run:
        assert run.wait(60) == 1
        status = run.summary()["status"]
    want = f"failed: --handoff {handoff}:3: not a handoff record (Expecting value: line 1 column 1 (char 0))"
    assert status == want, status

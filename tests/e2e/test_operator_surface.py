"""What an operator meets: a busy metrics port refused up front, a scrape that promtool accepts
mid-run, Ctrl-C that reports what finished, table rows that count what they say, quiet logs."""
from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fastkv import cli
from fastkv.cli import report
from fastkv.workload import REQUEST_FIELDS, check_request, read_workload
from tests.e2e.standins import ENTRIES
from tests.e2e.test_supervisor import SMALL, attach_signals, finish, leftovers, run_id, write_config
from tests.unit.test_metrics_exposition import promtool_check

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[2]


def cli_proc(tmp_path: Path, rid: str, *argv: str) -> subprocess.Popen:
    """The real supervisor, engine, worker and transfer process on the quick demo (24 requests)."""
    cmd = [sys.executable, "-m", "fastkv", "--out", str(tmp_path / "out"), "--run-id", rid, "--quick", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def scrape(port: int) -> str | None:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2).read().decode()
    except OSError:
        return None


def values(text: str, name: str) -> list[float]:
    return [s.value for fam in text_string_to_metric_families(text) for s in fam.samples if s.name == name]


def test_a_busy_metrics_port_is_one_line_before_anything_starts(tmp_path, capsys):
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(SystemExit) as exc:
            cli.main(["--out", str(tmp_path / "out"), "--quick", "--metrics-port", str(port)])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1, err
    assert f"--metrics-port {port}" in err and "Address already in use" in err
    assert not (tmp_path / "out").exists(), "nothing is written before the checks"


def test_no_progress_frames_into_a_file(tmp_path):
    """stderr is a pipe here: the progress bar stays off without --no-progress."""
    rid = run_id()
    argv = [a for a in SMALL if a != "--no-progress"]
    cmd = [sys.executable, "-m", "fastkv", "--out", str(tmp_path / "out"), "--run-id", rid, "--config",
           str(write_config(tmp_path)), *argv, *ENTRIES]
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc)
    assert code == 0, err
    assert "\r" not in err and "req/s" not in err, repr(err)
    assert leftovers(rid) == []


def test_a_mid_run_scrape_passes_promtool_and_the_run_ends_with_its_final_values(tmp_path):
    rid, port = run_id(), free_port()
    proc = cli_proc(tmp_path, rid, "--metrics-port", str(port))  # the default final scrape window
    mid = None
    deadline = time.monotonic() + 240
    while mid is None and proc.poll() is None and time.monotonic() < deadline:
        text = scrape(port)
        if text and 0 < sum(values(text, "fastkv_requests_finished_total")) < 24:
            mid = text  # some requests finished, others not: mid-run
        else:
            time.sleep(0.05)
    out_dir = tmp_path / "out"
    final = None
    while proc.poll() is None and final is None:  # the final scrape window, once the summary is written
        text = scrape(port) if (out_dir / "summary.json").exists() else None
        final = text if text and sum(values(text, "fastkv_requests_finished_total")) == 24 else None
        time.sleep(0.05)
    code, out, err = finish(proc, 120)
    assert code == 0, err
    assert mid is not None, "no scrape landed while the run was going"
    promtool_check(mid)
    assert sum(values(mid, "fastkv_requests")) > 0, "unfinished requests at the mid-run scrape"
    labels = {s.labels.get("role") for fam in text_string_to_metric_families(mid) for s in fam.samples}
    assert labels == {"mixed"}, labels
    assert all(s.labels["run_id"] == rid for fam in text_string_to_metric_families(mid) for s in fam.samples)
    assert final is not None, "the endpoint was gone before a scrape after the end"
    assert sum(values(final, "fastkv_hit_tokens_total")) > 0
    prom = (out_dir / "metrics.prom").read_text()
    promtool_check(prom)
    summary = json.loads((out_dir / "summary.json").read_text())
    assert sum(values(prom, "fastkv_lookup_tokens_total")) > 0
    assert sum(values(prom, "fastkv_copies_total")) == sum(summary["copy_tasks"].values())
    # the table counts what its words say
    verified = re.search(r"of (\d+) distinct requests", out)
    assert verified and 0 < int(verified.group(1)) <= 24, out
    assert "24 finished of 24  (24 reached max_new_tokens)" in out, out
    # quiet logs: no Paddle chatter, and the engine's log says how it started, with what, and how it ended
    logs = {p.name: p.read_text() for p in (out_dir / "logs").iterdir()}
    assert not any("No ccache found" in text for text in logs.values())
    engine_log = logs["engine.log"]
    assert f"run {rid}, role mixed, 24 requests" in engine_log and "device / 1024 host blocks" in engine_log
    assert "done: 24 of 24 requests finished" in engine_log, engine_log
    assert leftovers(rid) == []


def test_ctrl_c_at_request_10_of_24_prints_the_table_of_what_finished(tmp_path):
    rid = run_id()
    proc = cli_proc(tmp_path, rid, "--no-progress")
    sig = attach_signals(rid, proc)
    try:
        deadline = time.monotonic() + 120
        while sig["engine.finished"] < 10 and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        at = sig["engine.finished"]
    finally:
        sig.close()
    proc.send_signal(signal.SIGINT)
    code, out, err = finish(proc, 120)
    print(out, err, sep="\n")
    assert code == 130, err
    assert "run failed" not in err, err
    m = re.search(r"stopped by SIGINT after (\d+) of 24 requests", err)
    assert m and at <= int(m.group(1)) < 24, (at, err)
    assert "status" in out and f"stopped after {m.group(1)} of 24 requests finished" in out, out
    assert f"{m.group(1)} finished of 24" in out and "(prompts of all 24 requests)" in out, out
    out_dir = tmp_path / "out"
    assert (out_dir / "report.png").is_file() and str(out_dir / "report.png") in out
    assert str(out_dir / "results.jsonl") in out and str(out_dir / "logs") in out
    data = json.loads((out_dir / "report.json").read_text())
    assert data["status"] == "stopped" and data["requests"] == int(m.group(1))
    assert leftovers(rid) == []


def test_table_rows_say_what_they_count():
    base = {"requests": 3, "prompt_tokens": 10, "generated_tokens": 6, "seconds": 1.0, "tokens_per_s": 6.0,
            "recomputed_tokens": 0, "preemptions": {"recompute": 0, "offload": 0, "storage": 0},
            "hit_ratio": {"device": 0.0, "host": 0.0, "storage": 0.0}, "copy_gbps": 0.0, "step_ms_p50": 1.0,
            "step_ms_p99": 1.0, "task_ms_p50": 0.0, "timeline": [], "states": {"finished": 3},
            "verified": dict.fromkeys(("kv_blocks_verified", "kv_requests_verified", "kv_positions_read",
                                       "kv_mismatches"), 0)}
    tiny = report.table(report.build({**base, "runner": "tiny"}, []))
    assert "not checked: the tiny runner checks no KV" in tiny and "mismatches" not in tiny, tiny
    loads = {"lookups": 0, "requests": 0, "keys_found": 0, "keys_asked": 0, "latency_ms_mean": 0.0, "timed_out": 0,
             "bytes_loaded": 13_400_000, "blocks_loaded": 200, "loads_joined": 0}
    decode = report.table(report.build({**base, "storage_lookup": loads}, []))
    assert "storage lookups" not in decode and "200 blocks, 13.4 MB" in decode, decode
    rows = report.table(report.build(base, [{"id": str(i), "finish": "length"} for i in range(3)]))
    assert "3 finished of 3  (3 reached max_new_tokens)" in rows and "(length" not in rows, rows
    assert "KV cache" not in rows  # a summary from before the field
    fp8 = report.table(report.build({**base, "kv_cache_dtype": "fp8_e4m3", "kv_bytes_per_token": 17408}, []))
    assert "KV cache" in fp8 and "fp8_e4m3, 17408 bytes per token per rank" in fp8, fp8
    mla = report.table(report.build({**base, "kv_cache_dtype": "bfloat16", "kv_bytes_per_token": 70272,
                                     "kv_layout": "mla"}, []))
    assert "bfloat16 MLA latent, 70272 bytes per token per rank" in mla, mla
    assert report.title("decode", "/x/pre/workload.jsonl", "offload") == \
        "fastkv decode run, workload workload.jsonl, preemption offload"
    assert report.build(base, [])["timeline_columns"] == ["t_s", "finished_requests", "generated_tokens",
                                                          "preemptions"]


def test_the_unknown_field_error_names_the_request(tmp_path):
    path = tmp_path / "my.jsonl"
    rows = [{"id": "a", "arrival_s": 0, "prompt": [1, 2], "max_new_tokens": 2},
            {"id": "b7", "arrival_s": 0, "prompt": [1, 2], "max_tokens": 2, "max_new_tokens": 2}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"my.jsonl:2: request 'b7' has unknown fields \['max_tokens'\]"):
        read_workload(path)


def test_a_host_blocks_flag_over_a_files_swap_space_sizes_the_tier_and_the_banner_says_so(tmp_path):
    """Before, swap_space in the file won silently over --host-blocks (163 blocks for 200)."""
    rid = run_id()
    config = tmp_path / "job.json"
    config.write_text(json.dumps({"heartbeat_s": 0.1, "dead_after_s": 1.0, "swap_space": 0.001}))
    cmd = [sys.executable, "-m", "fastkv", "--out", str(tmp_path / "out"), "--run-id", rid, "--config", str(config),
           *SMALL, *ENTRIES]  # SMALL gives --host-blocks 8
    proc = subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    code, out, err = finish(proc)
    assert code == 0, err
    assert json.loads((tmp_path / "out" / "spec.json").read_text())["num_host_blocks"] == 8
    assert f"--host-blocks 8 (flags) overrides swap_space 0.001 (config file {config})" in err, err
    assert leftovers(rid) == []


def test_the_readme_documents_every_workload_field_and_the_timeline_columns():
    text = (ROOT / "README.md").read_text()
    table = text.split("A workload file (`--workload my.jsonl`)", 1)[1].split("```", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", table, re.M))
    assert documented == set(REQUEST_FIELDS), documented  # every field check_request takes, no other
    example = text.split("A workload file (`--workload my.jsonl`)", 1)[1].split("```")[1]
    for line in example.strip().splitlines():  # the example is a valid workload line
        check_request(json.loads(line))
    assert "[t_s, finished_requests,\ngenerated_tokens, preemptions]" in text

"""report.py: summary table, report.json and report.png from the engine's summary.json + results.jsonl."""
from __future__ import annotations

import json

import numpy as np
import pytest

from fastkv.cli import report


def summary(**over):
    doc = {
        "requests": 4, "prompt_tokens": 400, "generated_tokens": 40, "seconds": 2.0, "tokens_per_s": 20.0,
        "recomputed_tokens": 7, "preemptions": {"recompute": 1, "offload": 2, "storage": 0},
        "hit_ratio": {"device": 0.5, "host": 0.25, "storage": 0.0}, "copy_gbps": 3.5, "step_ms_p50": 1.25,
        "step_ms_p99": 9.5, "task_ms_p50": 0.75,
        "timeline": [[0.0, 0, 0, 0], [0.5, 1, 10, 1], [1.0, 2, 20, 2], [2.0, 4, 40, 3]],
    }
    doc.update(over)
    return doc


def results():
    return [{"id": f"r{i}", "output": [i], "finish": "length" if i else "stop", "ttft_s": 0.1 * (i + 1),
             "latency_s": 1.0 + i, "preemptions": i % 2, "recomputed_tokens": 0} for i in range(4)]


def write_run(tmp_path, doc=None, res=None):
    (tmp_path / "summary.json").write_text(json.dumps(doc or summary()))
    if res is not None:
        (tmp_path / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in res))


def test_report_files_and_table(tmp_path):
    write_run(tmp_path, res=results())
    rep = report.write(tmp_path, title="test run")
    data = json.loads(rep.json_path.read_text())
    assert data == rep.data
    assert data["ttft_s"]["p50"] == pytest.approx(np.percentile([0.1, 0.2, 0.3, 0.4], 50))
    assert data["latency_s"]["max"] == 4.0
    assert data["finish"] == {"stop": 1, "length": 3} and data["requests_preempted"] == 2
    for key, value in summary().items():
        assert data[key] == value
    png = rep.png_path.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    for text in ("20.0 generated tokens/s", "recompute 1, offload 2, storage 0  (2 requests)", "device 50.0%",
                 "host 25.0%", "recomputed tokens", "7", "p50 250.0 ms", "3.50 GB/s", "p99 9.50 ms"):
        assert text in rep.table, text


def test_without_results_and_with_a_single_point_timeline(tmp_path):
    write_run(tmp_path, summary(timeline=[[0.0, 0, 0, 0]]))
    rep = report.write(tmp_path)
    assert rep.data["ttft_s"] == {} and rep.data["finish"] == {}
    assert "p50 -" in rep.table and rep.png_path.is_file()


def test_bad_summaries_are_named(tmp_path):
    with pytest.raises(ValueError, match="summary.json not found"):
        report.write(tmp_path)
    doc = summary()
    del doc["copy_gbps"], doc["timeline"]
    write_run(tmp_path, doc)
    with pytest.raises(ValueError, match=r"lacks \['copy_gbps', 'timeline'\]"):
        report.write(tmp_path)
    write_run(tmp_path, summary(hit_ratio={"device": 1.0}))
    with pytest.raises(ValueError, match="'hit_ratio' must map each of"):
        report.write(tmp_path)


def test_storage_faults_are_shown(tmp_path):
    write_run(tmp_path, summary(storage_errors=3, corrupt_values=2, recomputed_because_storage=64))
    rep = report.write(tmp_path)
    assert "storage faults             3 failed operations, 2 corrupt values, 64 tokens recomputed" in rep.table
    assert rep.data["corrupt_values"] == 2
    write_run(tmp_path, summary())
    assert "storage faults             none" in report.write(tmp_path).table


def test_the_requests_row_counts_every_request_when_some_did_not_finish(tmp_path):
    """The row says finished of all, and each finish reason in words."""
    states = {"finished": 1, "aborted": 0, "rejected": 1, "unfinished": 0}
    write_run(tmp_path, summary(requests=1, states=states), res=results()[:1])
    assert report.write(tmp_path, title="t").table.splitlines()[0].split(None, 1)[1].startswith("1 finished of 2")
    write_run(tmp_path, summary(requests=4, states={**states, "finished": 4, "rejected": 0}), res=results())
    assert report.write(tmp_path, title="t").table.splitlines()[0].split(None, 1)[1].startswith("4 finished of 4  (")

"""The engine's metrics the Prometheus way: counters that sum across engines, gauges only for
levels, constant labels role and run_id, an exposition promtool accepts."""
from __future__ import annotations

import subprocess
from collections import Counter

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.engine.metrics import EngineMetrics
from fastkv.sched import Scheduler, SchedulerConfig
from tests.optional import PROMTOOL, require_binary
from tests.sched_harness import Rig


def promtool_check(text: str) -> None:
    """``promtool check metrics`` (Debian's prometheus package; .ci/run installs it) on ``text``."""
    promtool = require_binary("promtool", PROMTOOL)
    out = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, f"promtool check metrics:\n{out.stdout}{out.stderr}\n{text}"


def samples(text: str) -> list:
    return [s for fam in text_string_to_metric_families(text) for s in fam.samples]


def engine(run_id: str, role: str, prompts: list[list[int]]) -> EngineMetrics:
    """A scheduler that ran ``prompts`` one after another (a later one hits an earlier one's
    blocks) and its metrics."""
    rig = Rig(Scheduler(CacheManager(CacheConfig(num_device_blocks=16, num_host_blocks=8, block_size=4))))
    m = EngineMetrics(rig.sched, {"role": role, "run_id": run_id})
    for i, prompt in enumerate(prompts):
        rig.add(i, prompt, max_new_tokens=1)
        rig.run()
    return m


def test_requests_by_state_counts_requests_and_copies_in_flight_apart():
    """Mid-run, with requests running and waiting (two sequences a step, four requests): each
    state's gauge is the number of requests in that state, and a copy task is no request."""
    rig = Rig(Scheduler(CacheManager(CacheConfig(num_device_blocks=16, num_host_blocks=8, block_size=4)),
                        SchedulerConfig(max_num_seqs=2)))
    m = EngineMetrics(rig.sched, {"role": "mixed", "run_id": "r1"})
    for i in range(4):
        rig.add(i, list(range(10 * i, 10 * i + 9)), max_new_tokens=8)
    rig.step()
    by_state = Counter(r.state.name.lower() for r in rig.sched.requests.values())
    assert len(by_state) > 1 and sum(by_state.values()) == 4, by_state  # the states differ, none finished
    m.scheduler.outbox.in_flight[999] = object()  # a copy task sent and not done
    try:
        text = generate_latest(m.registry).decode()
    finally:
        del m.scheduler.outbox.in_flight[999]
    reqs = {s.labels["state"]: s.value for s in samples(text) if s.name == "fastkv_requests"}
    assert "copies_in_flight" not in reqs, reqs
    assert {k: v for k, v in reqs.items() if v} == by_state
    assert [s.value for s in samples(text) if s.name == "fastkv_copies_in_flight"] == [1.0]


def test_two_engines_hit_token_counters_sum_where_their_ratios_cannot():
    shared = list(range(100, 116))
    a = engine("run-a", "prefill", [shared, shared, shared])  # 2 of 3 prompts hit: ratio 2/3
    b = engine("run-b", "decode", [list(range(12)), list(range(200, 204)), list(range(300, 304)),
                                   list(range(400, 404)), list(range(12))])  # one hit in five
    texts = [generate_latest(m.registry).decode() for m in (a, b)]
    for text in texts:
        promtool_check(text)
    got = [s for t in texts for s in samples(t)]
    hits = [s for s in got if s.name == "fastkv_hit_tokens_total"]
    looked = [s for s in got if s.name == "fastkv_lookup_tokens_total"]
    assert {(s.labels["role"], s.labels["run_id"]) for s in hits} == {("prefill", "run-a"), ("decode", "run-b")}
    total_hits = sum(s.value for s in hits)  # sum by (tier) across engines: what a ratio gauge cannot give
    total_looked = sum(s.value for s in looked)
    stats = [m.scheduler.cache.stats for m in (a, b)]
    assert total_hits == sum(st.hit_tokens for st in stats) > 0
    assert total_looked == sum(st.prompt_tokens for st in stats)
    mean_of_ratios = np.mean([st.hit_ratio() for st in stats])
    assert total_hits / total_looked != pytest.approx(mean_of_ratios), "the fleet's ratio is no mean of ratios"
    assert not any(s.name.startswith("fastkv_hit_ratio") for s in got), "a ratio is derived, not exported"


def test_counters_for_copies_by_kind_and_bytes_and_storage_faults():
    m = engine("r2", "mixed", [list(range(8))])
    m.signals = {"storage.errors": 3, "storage.corrupt": 1, "transfer0.host_checksum_mismatches": 2}
    m.observe_copy("swap_out", True, 4096, 0.001)
    m.observe_copy("swap_out", True, 4096, 0.001)
    m.observe_copy("load", False, 0, 0.5)
    text = generate_latest(m.registry).decode()
    promtool_check(text)
    got = {(s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "run_id")))): s.value
           for s in samples(text)}
    assert got[("fastkv_copies_total", (("kind", "swap_out"),))] == 2
    assert got[("fastkv_copy_bytes_total", (("kind", "swap_out"),))] == 8192
    assert got[("fastkv_copy_failures_total", (("kind", "load"),))] == 1
    assert got[("fastkv_storage_errors_total", ())] == 3 and got[("fastkv_storage_corrupt_values_total", ())] == 1
    assert got[("fastkv_host_checksum_mismatches_total", (("rank", "0"),))] == 2
    assert got[("fastkv_storage_skipped_blocks_total", ())] == 0
    m.scheduler.cache.stats.skipped_stores = 5  # read at scrape time
    assert ("fastkv_storage_skipped_blocks_total", 5) in {(s.name, s.value) for s in samples(
        generate_latest(m.registry).decode())}
    m.scheduler.cache.stats.skipped_tail_stores = 3
    assert ("fastkv_storage_skipped_blocks_by_reason_total", (("reason", "tail"),), 3) in {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "run_id"))), s.value)
        for s in samples(generate_latest(m.registry).decode())}
    m.scheduler.hits.stats.recomputed_tokens["storage"] = 48  # the hit policy's choices, read at scrape time
    assert ("fastkv_hit_choice_tokens_total", (("choice", "recompute"), ("tier", "storage")), 48) in {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k not in ("role", "run_id"))), s.value)
        for s in samples(generate_latest(m.registry).decode())}
    gauges = {fam.name for fam in text_string_to_metric_families(text) if fam.type == "gauge"}
    assert gauges == {"fastkv_blocks", "fastkv_requests", "fastkv_copies_in_flight"}


def test_frozen_metrics_keep_the_last_values_and_the_textfile_holds_them(tmp_path):
    m = engine("r3", "mixed", [list(range(8)), list(range(8))])
    before = generate_latest(m.registry).decode()
    m.freeze()
    m.scheduler.cache.stats.device_hit_tokens += 1000  # the engine moved on / let go: not seen any more
    assert generate_latest(m.registry).decode() == before
    path = m.write_textfile(tmp_path / "metrics.prom")
    promtool_check(path.read_text())
    assert path.read_text() == before

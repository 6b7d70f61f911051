"""Async scheduling through real processes: the same workload with ``async_scheduling`` off
and on gives identical outputs (equal to the synthetic model's reference), in every
preemption mode, at tp 1 and 2, under preemption pressure, with every KV block the workers
read verified by the synthetic runner's oracle."""
from __future__ import annotations

import pytest

from tests.e2e.test_engine_synthetic import check_outputs, run_once, workload

MODES = ["recompute", "offload", "storage", "auto"]


@pytest.mark.parametrize("tp", [1, 2])
def test_sync_and_async_give_identical_outputs_in_every_mode(tmp_path, tp):
    wl = workload(16, 14, MODES)
    runs = {}
    for mode in ("off", "on"):
        url = f"lmdb://{tmp_path}/lmdb-{mode}?max_bytes=64M"
        runs[mode] = run_once(tmp_path, f"async-{mode}", url, wl, tp=tp, async_scheduling=mode == "on")
    (off, s_off), (on, s_on) = runs["off"], runs["on"]
    assert {k: v["output"] for k, v in off.items()} == {k: v["output"] for k, v in on.items()}
    check_outputs(on, wl)
    for summary in (s_off, s_on):
        assert sum(summary["preemptions"].values()) > 0, f"no preemption under pressure: {summary}"
        assert summary["verified"]["kv_requests_verified"] > 0, summary
    assert not s_off["async_scheduling"]["on"] and s_off["async_scheduling"]["overlapped_steps"] == 0
    assert s_on["async_scheduling"]["on"] and s_on["async_scheduling"]["overlapped_steps"] > 0, s_on

#!/usr/bin/env python
"""Cost-aware hits: the restart pair under a 10 GbE and a 100 GbE pool, run B under each --hit-policy.

Run A (``--workload trace:N``, a fresh LMDB pool, a storage backlog large enough that every
block is stored) fills the pool. Each run B is a new supervisor on a copy of that pool with A's
``workload.jsonl``, under the synthetic runner's cost model of one pool deployment
(``llama3-8b-h100-sxm-pool10g``, ``-pool100g``) and one ``--hit-policy``. Over 10 GbE a block
loads slower than it recomputes, over 100 GbE faster: ``auto`` should match the better policy on
each. Every B's outputs must be A's (the synthetic runner's oracle also checks each run). The
runs of one repeat go in turn, policies interleaved (each repeat starts with another), and each
figure is the median over repeats.

The last line is {"bench": "hits", "ttft_p50_s": {"pool10g": {"auto": .., "load": ..,
"recompute": ..}, "pool100g": {...}}, "outputs_identical": true, ...}.
"""
from __future__ import annotations

import json
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pool import restart_pair_args, supervise  # noqa: E402

from fastkv.sched.hits import HIT_POLICIES  # noqa: E402

POOLS = {"pool10g": "llama3-8b-h100-sxm-pool10g", "pool100g": "llama3-8b-h100-sxm-pool100g"}
GOAL = 1.05  # auto within 5 % of the better policy (10 GbE) or of load (100 GbE)


def config(tmp: Path, pool: str, gbps: float) -> Path:
    path = tmp / f"{pool}.toml"
    path.write_text(f'[runner_options]\ncost_model = "{POOLS[pool]}"\ncopy_gbps = {gbps}\n')
    return path


def outputs(rows: dict[str, dict]) -> dict[str, list[int]]:
    return {rid: r["output"] for rid, r in rows.items()}


def main() -> int:
    args, shape, gbps = restart_pair_args(__doc__, "pool and policy")
    tmp = Path(tempfile.mkdtemp(prefix="bench_hits."))
    try:
        cfgs = {pool: config(tmp, pool, gbps) for pool in POOLS}
        a_report, a_rows = supervise(tmp / "A", f"lmdb://{tmp}/pool", f"trace:{args.requests}",
                                     ["--config", str(cfgs["pool100g"]), "--storage-backlog-blocks", "1000000",
                                      *shape])
        want = outputs(a_rows)
        runs: dict[str, dict[str, list[dict]]] = {pool: {p: [] for p in HIT_POLICIES} for pool in POOLS}
        identical = True
        for rep in range(args.repeats):
            for pool in POOLS:  # each repeat starts with another policy: no policy always runs first
                for policy in HIT_POLICIES[rep % 3:] + HIT_POLICIES[:rep % 3]:
                    store = tmp / "B-pool"
                    shutil.rmtree(store, ignore_errors=True)
                    shutil.copytree(tmp / "pool", store)
                    out = tmp / f"B-{pool}-{policy}-{rep}"
                    report, rows = supervise(out, f"lmdb://{store}", str(tmp / "A" / "workload.jsonl"),
                                             ["--config", str(cfgs[pool]), "--hit-policy", policy, *shape])
                    identical &= outputs(rows) == want
                    runs[pool][policy].append(report)
                    shutil.rmtree(out)

        def med(pool: str, policy: str, get) -> float:
            return round(statistics.median(get(r) for r in runs[pool][policy]), 4)

        ttft = {pool: {p: med(pool, p, lambda r: r["ttft_s"]["p50"]) for p in HIT_POLICIES} for pool in POOLS}
        storage = {pool: {p: med(pool, p, lambda r: r["hit_ratio"]["storage"]) for p in HIT_POLICIES}
                   for pool in POOLS}
        print(f"restart pair on trace:{args.requests}, {args.repeats} run(s) B each, cost model scaled to "
              f"{gbps} GB/s of copies here; run A TTFT p50 {a_report['ttft_s']['p50']:.4f} s")
        print("| pool | policy | B TTFT p50 | B storage hit ratio | auto's choice (tokens loaded / recomputed) |")
        print("|---|---|---|---|---|")
        for pool in POOLS:
            for p in HIT_POLICIES:
                h = runs[pool][p][-1]["hits"]
                choice = (f"{h['loaded_tokens']['storage']} / {h['recomputed_tokens']['storage']}"
                          if p == "auto" else "")
                print(f"| {pool} | {p} | {ttft[pool][p]:.4f} s | {storage[pool][p]:.3f} | {choice} |")
        best10 = min(ttft["pool10g"]["load"], ttft["pool10g"]["recompute"])
        goals = {"pool10g_auto_vs_best": round(ttft["pool10g"]["auto"] / best10, 3),
                 "pool100g_auto_vs_load": round(ttft["pool100g"]["auto"] / ttft["pool100g"]["load"], 3)}
        print(json.dumps({"bench": "hits", "requests": args.requests, "repeats": args.repeats, "copy_gbps": gbps,
                          "ttft_p50_s": ttft, "storage_hit_ratio": storage,
                          "ttft_p50_s_runs": {pool: {p: {str(i): round(r["ttft_s"]["p50"], 4)
                                                         for i, r in enumerate(runs[pool][p], 1)}
                                                     for p in HIT_POLICIES} for pool in POOLS},
                          "ttft_p50_s_run_a": round(a_report["ttft_s"]["p50"], 4), "ratios": goals,
                          "goals_met": all(v <= GOAL for v in goals.values()), "outputs_identical": identical}))
        return 0 if identical else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""The storage tier as one pool: the Mooncake conversation trace replayed by two engines in
turn on one store (issue 13's benchmark).

Engine 1 is a supervisor running ``--workload trace:N`` on a fresh store; engine 2 is a new
supervisor on the same store with engine 1's ``workload.jsonl`` (the same requests), so
everything it can hit there, it finds only by its storage lookup at admission. Reported:

- engine 2's storage hit ratio (prompt tokens served from storage) and its hit ratio over all
  tiers, next to the unbounded ideal: the fraction of its prompt tokens in full blocks engine
  1 computed (every full block but one that holds a prompt's last token, as a hit leaves the
  last token to compute). A block engine 2 needs twice is loaded once and then hit on its
  device or host, so its storage share is bounded by the distinct blocks, also reported
  (``ideal_distinct``: tokens in the first occurrence of each block, in arrival order).
- the lookup's cost per admitted request (engine 2's summed LOOKUP round trips over the
  requests it asked for) next to one IPC round trip of fastkv's channel (bench_ipc's
  measurement, reused): the lookup is one LOOKUP task per admission wave through the transfer
  processes, so it costs an IPC round trip plus the store's ``exists`` batch.

The last line is {"bench": "pool", ...}. ``--storage redis://HOST:PORT`` uses that Redis
instead of an LMDB directory (removed afterwards).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_swap import EchoPeer  # noqa: E402

SMOKE_SHAPE = ["--layers", "1", "--kv-heads", "1", "--head-dim", "16"]


def restart_pair_args(doc: str, per: str) -> tuple[argparse.Namespace, list[str], float]:
    """The flags of a restart-pair bench (runs B ``per`` what it compares): its arguments, the model
    shape flags (``--smoke``'s tiny one, or none) and the copy GB/s the cost model is scaled to."""
    from fastkv.cli import at_least
    from fastkv.deploy.cost_model import measure_copy_bandwidth

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--requests", type=at_least(1), default=64, help="trace requests (default 64)")
    ap.add_argument("--repeats", type=at_least(1), default=3, help=f"runs B per {per} (default 3)")
    ap.add_argument("--smoke", action="store_true", help="4 requests, one repeat, a tiny model shape: checks that "
                    "the script runs (its figures mean nothing)")
    ap.add_argument("--copy-gbps", type=at_least(0.0, float), default=0.0, help="this machine's copy bandwidth "
                    "the cost model is scaled to (default: measured once, the same for every run)")
    args = ap.parse_args()
    if args.smoke:
        args.requests, args.repeats = 4, 1
    return args, SMOKE_SHAPE if args.smoke else [], args.copy_gbps or round(measure_copy_bandwidth() / 1e9, 2)


def supervise(out: Path, store: str, workload: str, shape: list[str]) -> tuple[dict, dict[str, dict]]:
    """One supervisor run: its report.json, and its results.jsonl rows by request id."""
    cmd = [sys.executable, "-m", "fastkv", "--no-progress", "--out", str(out), "--storage", store,
           "--workload", workload, *shape]
    proc = subprocess.run(cmd, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"bench_pool: {out.name} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    return json.loads((out / "report.json").read_text()), {r["id"]: r for r in rows}


def ideals(workload: Path, block_size: int) -> tuple[float, float]:
    """(all full blocks, first occurrences only) as fractions of the prompt tokens."""
    seen: set[tuple[int, ...]] = set()
    total = hit = distinct = 0
    for line in workload.read_text().splitlines():
        prompt = json.loads(line)["prompt"]
        total += len(prompt)
        for i in range((len(prompt) - 1) // block_size):
            block = tuple(prompt[:(i + 1) * block_size])  # a block's identity is its whole prefix
            hit += block_size
            if block not in seen:
                seen.add(block)
                distinct += block_size
    return hit / total, distinct / total


def ipc_rtt_us(n: int) -> float:
    """Median round trip of one task message through fastkv channels and an echo process."""
    echo = EchoPeer()
    try:
        return 1e6 * statistics.median(echo.ping() for _ in range(n))
    finally:
        echo.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=64, help="trace requests per engine (trace:N)")
    ap.add_argument("--storage", default="", help="a redis:// URL (default: an LMDB directory of its own)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds: checks that the script runs "
                    "(the tests); the numbers mean nothing")
    args = ap.parse_args()
    n = 6 if args.smoke else args.requests
    shape = SMOKE_SHAPE if args.smoke else []
    tmp = Path(tempfile.mkdtemp(prefix="fkv-bench-pool-"))
    try:
        store = args.storage or f"lmdb://{tmp}/store"
        first, first_rows = supervise(tmp / "engine1", store, f"trace:{n}", shape)
        wl = tmp / "engine1" / "workload.jsonl"
        second, second_rows = supervise(tmp / "engine2", store, str(wl), shape)
        spec = json.loads((tmp / "engine1" / "spec.json").read_text())
        ideal, ideal_distinct = ideals(wl, int(spec["layout"]["block_size"]))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # a hit ratio counts only when both engines served every request, the same tokens
    unfinished = [(rid, r["state"], r.get("reason")) for rows in (first_rows, second_rows) for rid, r in rows.items()
                  if r["state"] != "finished"]
    if unfinished:
        sys.exit(f"bench_pool: {len(unfinished)} requests did not finish, e.g. {unfinished[0]}")
    identical = first_rows.keys() == second_rows.keys() and all(
        first_rows[rid]["output"] == second_rows[rid]["output"] for rid in first_rows)
    lk = second["storage_lookup"]
    lookup_us = 1e6 * lk["seconds"] / max(lk["requests"], 1)
    rtt = ipc_rtt_us(20 if args.smoke else 2000)
    res = {"bench": "pool", "requests": n,
           "hit": {"storage": round(second["hit_ratio"]["storage"], 4), "all_tiers": round(sum(
               second["hit_ratio"].values()), 4), "ideal": round(ideal, 4), "ideal_distinct": round(ideal_distinct, 4),
               "first_engine": round(sum(first["hit_ratio"].values()), 4)},
           "ttft_p50_s": {"first": round(first["ttft_s"]["p50"], 4), "second": round(second["ttft_s"]["p50"], 4)},
           "lookup_us_per_request": round(lookup_us, 1), "lookup_ms_per_wave": round(lk["latency_ms_mean"], 3),
           "ipc_rtt_us": round(rtt, 1), "keys_found": lk["keys_found"], "keys_asked": lk["keys_asked"],
           "loads_joined": lk.get("loads_joined", 0), "outputs_identical": identical}
    h = res["hit"]
    print(f"{'':28}{'engine 1':>12}{'engine 2':>12}{'ideal':>12}")
    print(f"{'storage hit ratio':28}{0:12.3f}{h['storage']:12.3f}{h['ideal_distinct']:12.3f}  (distinct blocks)")
    print(f"{'hit ratio, all tiers':28}{h['first_engine']:12.3f}{h['all_tiers']:12.3f}{h['ideal']:12.3f}")
    print(f"{'TTFT p50 s':28}{res['ttft_p50_s']['first']:12.3f}{res['ttft_p50_s']['second']:12.3f}")
    print(f"lookup: {lk['lookups']} waves for {lk['requests']} requests, {lookup_us:.0f} us per request "
          f"({lk['latency_ms_mean']:.2f} ms per wave); fastkv IPC round trip {rtt:.1f} us; "
          f"{lk['keys_found']} of {lk['keys_asked']} keys found, {res['loads_joined']} blocks from loads in flight; "
          f"every request finished in both, outputs identical: {identical}")
    print(json.dumps(res))


if __name__ == "__main__":
    main()

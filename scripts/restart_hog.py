#!/usr/bin/env python
"""The restart pair beside a CPU hog: does the pool keep its value on a busy machine?

Run A (``--workload trace:N`` on a fresh pool) fills the pool; run B, a new supervisor on the same
pool with A's ``workload.jsonl``, should serve its prompts from there. Both run beside ``--hogs``
busy processes (default: one per core less one), so the engine, the workers and the transfer
processes share the machine with CPU-bound work. Reported: B's storage hit ratio and TTFT p50
against A's, what A's storage writes skipped (by reason) and how many of B's lookups timed out.
Goals: B serves >= 0.85 of its prompt tokens from storage, and its TTFT p50 is <= 0.25x A's.

The last line is {"bench": "restart_hog", ...}. ``--storage URL`` uses that pool (it must be
empty) instead of a fresh LMDB directory.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pool import SMOKE_SHAPE, supervise  # noqa: E402

from fastkv.cli import at_least  # noqa: E402

GOALS = {"storage_hit_ratio": 0.85, "ttft_p50_ratio": 0.25}  # B's at least / at most


def hogs(n: int) -> list[subprocess.Popen]:
    """``n`` processes that keep a core busy until killed."""
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=at_least(1), default=64, help="trace requests (default 64)")
    ap.add_argument("--hogs", type=at_least(0), default=max(0, (os.cpu_count() or 1) - 1),
                    help="busy processes beside the runs (default: one per core less one)")
    ap.add_argument("--storage", help="an empty pool's URL (default: a fresh LMDB directory)")
    ap.add_argument("--smoke", action="store_true", help="4 requests, a tiny model shape: checks that the script "
                    "runs (its figures mean nothing)")
    args = ap.parse_args()
    if args.smoke:
        args.requests = 4
    shape = SMOKE_SHAPE if args.smoke else []
    tmp = Path(tempfile.mkdtemp(prefix="restart_hog."))
    busy = hogs(args.hogs)
    try:
        url = args.storage or f"lmdb://{tmp}/pool"
        a, _ = supervise(tmp / "A", url, f"trace:{args.requests}", shape)
        b, _ = supervise(tmp / "B", url, str(tmp / "A" / "workload.jsonl"), shape)
    finally:
        for p in busy:
            p.kill()
            p.wait()
        shutil.rmtree(tmp, ignore_errors=True)
    ttft = {"a": round(a["ttft_s"]["p50"], 4), "b": round(b["ttft_s"]["p50"], 4)}
    got = {"storage_hit_ratio": round(b["hit_ratio"]["storage"], 3),
           "ttft_p50_ratio": round(ttft["b"] / ttft["a"], 3) if ttft["a"] else 0.0}
    print(f"restart pair on trace:{args.requests} beside {args.hogs} busy process(es): B serves "
          f"{got['storage_hit_ratio']:.3f} of its prompt tokens from storage, TTFT p50 {ttft['b']:.4f} s against "
          f"A's {ttft['a']:.4f} s ({got['ttft_p50_ratio']:.3f}x)")
    print(json.dumps({"bench": "restart_hog", "requests": args.requests, "hogs": args.hogs, "ttft_p50_s": ttft,
                      **got, "a_stored": a.get("storage_blocks_stored", 0),
                      "a_skipped_by": a.get("storage_blocks_skipped_by", {}),
                      "a_stored_late": a.get("storage_blocks_stored_late", 0),
                      "b_hits": {k: b.get("hits", {}).get(k, {}) for k in ("loaded_tokens", "recomputed_tokens")},
                      "b_lookup": {k: b.get("storage_lookup", {}).get(k, 0) for k in (
                          "requests", "keys_asked", "keys_found", "timed_out", "failed", "latency_ms_mean")},
                      "goals_met": got["storage_hit_ratio"] >= GOALS["storage_hit_ratio"]
                      and got["ttft_p50_ratio"] <= GOALS["ttft_p50_ratio"]}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

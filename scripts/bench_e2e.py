#!/usr/bin/env python
"""End to end: the demo workload under memory pressure through the whole system (supervisor,
engine, workers, transfer processes), once per preemption mode, side by side.

Runs (same workload, same capacities, fresh LMDB store each):

- ``recompute``: preemption by recompute as the prior art does it (FastDeploy's ResourceManagerV1,
  vLLM v1): prefix reuse only from the device tier (``host_blocks 0``, no storage tier);
- ``offload`` and ``storage``: fastkv's preemption modes, with the host tier (and LMDB);
- ``recompute + host cache``: fastkv's recompute beside its host prefix cache, for reference
  (re-admission swaps the preempted request's full blocks back in; only partial blocks recompute).

Prints tokens/s, recomputed tokens, time to first token, hit ratio per tier and preemptions
per run, then, as the LAST line:

    {"bench": "e2e", "tokens_per_s": {"recompute": ..., "offload": ..., "storage": ...},
     "recomputed_tokens": {...same keys}, "outputs_identical": true|false, "outputs_correct": true|false|null,
     "verified": {...same keys: what the runner verified}}

with ``outputs_identical`` over every run: every request finished
with the same tokens whatever the preemption mode and tiers; ``outputs_correct``: with the
synthetic runner, every run's outputs equal the synthetic model's, computed from the prompts
without any cache (its next token depends on the KV it reads, so wrong KV shows here); null
with another runner. ``--quick``: the quick demo
(target: < 3 minutes on the development machine).
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv import report  # noqa: E402
from fastkv.cli import JobConfig, prepare  # noqa: E402
from fastkv.demo import read_workload  # noqa: E402
from fastkv.supervisor import Supervisor  # noqa: E402

MODES = ("recompute", "offload", "storage")
SMOKE_DEMO = {"conversations": 2, "turns": 2, "system_tokens": 32, "user_tokens": (8, 16), "reply_tokens": 8,
              "max_new_tokens": 16}


# (label, preemption mode, host tier on); the first three labels are the JSON keys (MODES)
RUNS = [("recompute", "recompute", False), ("offload", "offload", True), ("storage", "storage", True),
        ("recompute + host cache", "recompute", True)]


def run_one(base: JobConfig, label: str, mode: str, host: bool, out: Path, entries: dict[str, str]) -> dict:
    cfg = JobConfig(**{**base.__dict__, "preemption": mode, "host_blocks": base.host_blocks if host else 0,
                       "storage": base.storage if host else "none", "out": str(out)})
    spec, workload = prepare(cfg)
    result = Supervisor(spec, workload, entry_points=entries).run()
    if not result.ok:
        raise SystemExit(f"bench_e2e: run {label!r} failed: {result.message}")
    data = report.write(out, title=f"bench e2e: {label}").data
    with (out / "results.jsonl").open() as f:
        data["outputs"] = {r["id"]: (r["finish"], r["output"]) for r in map(json.loads, f)}
    if spec.runner == "synthetic":  # its outputs are known without any cache: check each run alone
        from fastkv.engine.runners.synthetic import DEFAULT_VOCAB, reference_output

        vocab = spec.runner_options.get("vocab", DEFAULT_VOCAB)
        data["outputs_correct"] = all(
            data["outputs"].get(w["id"]) == ("length", reference_output(w["prompt"], w["max_new_tokens"], vocab,
                                                                         spec.layout.dtype, spec.weights_version))
            for w in read_workload(workload))
    return data


def fmt_row(label: str, d: dict) -> str:
    ttft, hit, pre = d["ttft_s"], d["hit_ratio"], d["preemptions"]
    ms = lambda k: f"{1e3 * ttft[k]:.0f}" if k in ttft else "-"  # noqa: E731
    return (f"| {label} | {d['tokens_per_s']:.1f} | {d['recomputed_tokens']} | {ms('p50')} | {ms('p99')} | "
            f"{100 * hit['device']:.1f}/{100 * hit['host']:.1f}/{100 * hit['storage']:.1f} | "
            f"{pre['recompute']}/{pre['offload']}/{pre['storage']} | {d['seconds']:.1f} |")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick demo workload")
    p.add_argument("--smoke", action="store_true",
                    help="2 conversations x 2 short turns (tests: numbers mean nothing)")
    p.add_argument("--runner", choices=("synthetic", "tiny"), default="synthetic")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--device-blocks", type=int, default=JobConfig.device_blocks)
    p.add_argument("--host-blocks", type=int, default=JobConfig.host_blocks)
    p.add_argument("--storage", default="default", help="storage URL for every run (default: fresh LMDB per run)")
    p.add_argument("--out", help="keep each run's output here (default: a temporary directory, removed)")
    p.add_argument("--entry", action="append", default=[], metavar="ROLE=MODULE:FUNC", help="as fastkv-supervisor")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="No ccache found")
    entries = dict(e.split("=", 1) for e in args.entry)
    base = JobConfig(runner=args.runner, tp=args.tp, device_blocks=args.device_blocks, host_blocks=args.host_blocks,
                     storage=args.storage, quick=args.quick or args.smoke, demo=SMOKE_DEMO if args.smoke else {})
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fastkv-bench-e2e-"))
    print(f"demo workload: {len(base.requests())} requests; {args.runner} runner, tp {args.tp}, "
          f"{args.device_blocks} device / {args.host_blocks} host blocks per rank", flush=True)
    results: dict[str, dict] = {}
    try:
        for label, mode, host in RUNS:
            print(f"running {label} ...", flush=True)
            results[label] = run_one(base, label, mode, host, root / label.replace(" + ", "-").replace(" ", "-"),
                                     entries)
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    print("\n| run | tokens/s | recomputed tokens | TTFT p50 ms | TTFT p99 ms | hit % device/host/storage "
          "| preemptions recompute/offload/storage | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for label, d in results.items():
        print(fmt_row(label, d))
    outputs = [d["outputs"] for d in results.values()]
    finished = all(finish in ("length", "stop") for finish, _ in outputs[0].values())
    identical = finished and all(o == outputs[0] for o in outputs)
    correct = [d.get("outputs_correct") for d in results.values()]
    correct = None if None in correct else all(correct)
    speedup = results["offload"]["tokens_per_s"] / max(results["recompute"]["tokens_per_s"], 1e-9)
    print(f"\noffload / recompute throughput: {speedup:.2f}x; outputs identical across runs: {identical}; "
          f"equal to the synthetic model's (computed without a cache): {correct}")
    print(json.dumps({
        "bench": "e2e",
        "tokens_per_s": {m: round(results[m]["tokens_per_s"], 1) for m in MODES},
        "recomputed_tokens": {m: results[m]["recomputed_tokens"] for m in MODES},
        "outputs_identical": identical,
        "outputs_correct": correct,
        "verified": {m: results[m].get("verified") for m in MODES},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

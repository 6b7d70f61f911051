#!/usr/bin/env python
"""Layer-wise loading: the restart pair on storage hits, run B with --layerwise-load on and off.

Run A (``--workload trace:N``, a fresh LMDB pool, a storage backlog large enough that every block
is stored) fills the pool. Each run B is a new supervisor on a copy of that pool with A's
``workload.jsonl`` and ``--hit-policy load``, under the synthetic runner's cost model of the
8B deployment whose pool sits behind 100 GbE (``llama3-8b-h100-sxm-pool100g``), with
``--layerwise-load on`` (a hit's host -> device copy lands layer by layer and its step's layer l
starts once layer l landed) or ``off`` (the step waits for the whole copy). The runs of one
repeat alternate which goes first; each figure is the median over repeats. Every B's outputs must
be A's. The table gives the deployment's per-layer timings for a typical hit (unscaled: GPU
time), which bound what overlap can save: a storage hit is LOADed whole into the host tier (its
value is checked whole), then copied to the device; only that copy overlaps the step's layers.

A second pair isolates that copy: host hits. One run per mode, no storage tier, a device tier of
300 blocks: a 2048-token prompt is computed, four others push it out to the host tier, then it
comes back with 256 more tokens, alone (``HOST_ROUNDS`` times, fillers between). Its TTFT is the
host -> device copy of 2048 tokens and the compute of 256, which layer-wise loading overlaps.

The last line is {"bench": "layerwise", "ttft_p50_s": {"layerwise": .., "whole": ..},
"ratio": .., "host_ttft_p50_s": {...}, "host_ratio": .., "outputs_identical": true, ...}.
"""
from __future__ import annotations

import json
import random
import shutil
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

from bench_pool import restart_pair_args, supervise  # noqa: E402

from fastkv.deploy.cost_model import deployment  # noqa: E402

MODEL = "llama3-8b-h100-sxm-pool100g"
MODES = {"layerwise": "on", "whole": "off"}
GOAL = 0.75  # layerwise TTFT p50 at most this times the whole load's
HOST_ROUNDS = 8


def host_workload(path: Path, prompt_len: int = 2048, extra: int = 256) -> list[str]:
    """The host-hit pair's requests (module docstring); returns the ids of the returning prompts."""
    rng = random.Random(7)
    tokens = lambda n: [rng.randrange(1000) for _ in range(n)]  # noqa: E731
    base = tokens(prompt_len)
    rows = [{"id": "first", "arrival_s": 0.0, "prompt": base, "max_new_tokens": 4}]
    again = []
    for k in range(HOST_ROUNDS):
        t = 0.5 + 1.0 * k
        rows += [{"id": f"fill{k}.{i}", "arrival_s": t + 0.1 * i, "prompt": tokens(prompt_len), "max_new_tokens": 4}
                 for i in range(4)]
        again.append(f"again{k}")
        rows.append({"id": again[-1], "arrival_s": t + 0.8, "prompt": base + tokens(extra), "max_new_tokens": 4})
    path.write_text("".join(json.dumps({**r, "preemption": None}) + "\n" for r in rows))
    return again


def layer_timings(hit: int, new: int) -> dict[str, float]:
    """The deployment's GPU microseconds per layer for a hit of ``hit`` tokens and ``new`` computed."""
    dep = deployment(MODEL)
    return {"compute_us": round(1e6 * dep.layer_seconds([(hit, hit + new)])[0], 1),
            "copy_us": round(1e6 * dep.layer_copy_seconds(hit), 1),
            "storage_us": round(1e6 * hit * dep.kv_bytes_per_token / dep.storage_bandwidth / dep.layers, 1)}


def main() -> int:
    args, shape, gbps = restart_pair_args(__doc__, "mode")
    tmp = Path(tempfile.mkdtemp(prefix="bench_layerwise."))
    try:
        cfg = tmp / "model.toml"
        # verify off: the runner's byte checks are CPU work no GPU does, and they would sit in every
        # TTFT beside the copies; the oracle still reads every position's KV, so a wrong block
        # still changes the outputs
        cfg.write_text(f'[runner_options]\ncost_model = "{MODEL}"\ncopy_gbps = {gbps}\nverify = "off"\n')
        common = ["--config", str(cfg), "--hit-policy", "load", *shape]
        a_report, a_rows = supervise(tmp / "A", f"lmdb://{tmp}/pool", f"trace:{args.requests}",
                                     [*common, "--storage-backlog-blocks", "1000000"])
        want = {rid: r["output"] for rid, r in a_rows.items()}
        runs: dict[str, list[dict]] = {m: [] for m in MODES}
        identical = True
        for rep in range(args.repeats):
            order = list(MODES) if rep % 2 == 0 else list(MODES)[::-1]
            for mode in order:
                store = tmp / "B-pool"
                shutil.rmtree(store, ignore_errors=True)
                shutil.copytree(tmp / "pool", store)
                out = tmp / f"B-{mode}-{rep}"
                report, rows = supervise(out, f"lmdb://{store}", str(tmp / "A" / "workload.jsonl"),
                                         [*common, "--layerwise-load", MODES[mode]])
                identical &= {rid: r["output"] for rid, r in rows.items()} == want
                runs[mode].append(report)
                shutil.rmtree(out)

        host_wl = tmp / "host.jsonl"
        again = host_workload(host_wl)
        host: dict[str, list[float]] = {m: [] for m in MODES}
        host_outputs: dict[str, dict] = {}
        for rep in range(args.repeats):
            for mode in (list(MODES) if rep % 2 == 0 else list(MODES)[::-1]):
                out = tmp / f"H-{mode}-{rep}"
                _, rows = supervise(out, "none", str(host_wl), [*common, "--device-blocks", "300", "--host-blocks",
                                                                "4096", "--layerwise-load", MODES[mode]])
                host[mode].append(statistics.median(rows[i]["ttft_s"] for i in again))
                outs = {rid: r["output"] for rid, r in rows.items()}
                identical &= host_outputs.setdefault("want", outs) == outs
                shutil.rmtree(out)
        host_ttft = {m: round(statistics.median(host[m]), 4) for m in MODES}
        host_ratio = round(host_ttft["layerwise"] / host_ttft["whole"], 3) if host_ttft["whole"] else 0.0

        def med(mode: str, get) -> float:
            return round(statistics.median(get(r) for r in runs[mode]), 4)

        ttft = {m: med(m, lambda r: r["ttft_s"]["p50"]) for m in MODES}
        mean = {m: med(m, lambda r: r["ttft_s"]["mean"]) for m in MODES}
        storage = {m: med(m, lambda r: r["hit_ratio"]["storage"]) for m in MODES}
        layered = {m: runs[m][-1].get("layerwise_load", {}) for m in MODES}
        ratio = round(ttft["layerwise"] / ttft["whole"], 3) if ttft["whole"] else 0.0
        timings = layer_timings(2048, 256)
        print(f"restart pair on trace:{args.requests}, {args.repeats} run(s) B per mode, {MODEL} scaled to {gbps} "
              f"GB/s of copies here; run A TTFT p50 {a_report['ttft_s']['p50']:.4f} s")
        print(f"per layer of a 2048-token hit with 256 tokens computed (GPU time): compute {timings['compute_us']} us, "
              f"host -> device copy {timings['copy_us']} us, storage load {timings['storage_us']} us")
        print("| run B | TTFT p50 | TTFT mean | storage hit ratio | layered swap-ins | plans on landing copies |")
        print("|---|---|---|---|---|---|")
        for m in MODES:
            print(f"| {m} | {ttft[m]:.4f} s | {mean[m]:.4f} s | {storage[m]:.3f} | "
                  f"{layered[m].get('layered_swap_ins', 0)} | {layered[m].get('plans_on_landing_copies', 0)} |")
        print(f"host hits ({HOST_ROUNDS} returning 2048-token prompts, 256 tokens more, median TTFT per run): "
              f"layerwise {host_ttft['layerwise']:.4f} s, whole {host_ttft['whole']:.4f} s ({host_ratio:.3f}x)")
        print(json.dumps({"bench": "layerwise", "requests": args.requests, "repeats": args.repeats, "model": MODEL,
                          "copy_gbps": gbps, "ttft_p50_s": ttft, "ttft_mean_s": mean, "storage_hit_ratio": storage,
                          "ratio": ratio, "layer_us": timings,
                          "ttft_p50_s_runs": {m: {str(i): round(r["ttft_s"]["p50"], 4)
                                                  for i, r in enumerate(runs[m], 1)} for m in MODES},
                          "host_ttft_p50_s": host_ttft, "host_ratio": host_ratio,
                          "host_ttft_runs": {m: {str(i): round(t, 4) for i, t in enumerate(host[m], 1)} for m in MODES},
                          "goal_met": ratio <= GOAL, "outputs_identical": identical}))
        return 0 if identical else 1
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())

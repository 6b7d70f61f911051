#!/usr/bin/env python
"""End to end: the demo workload under memory pressure through the whole system (supervisor,
engine, workers, transfer processes), once per preemption mode, side by side, under a cost
model of a named GPU deployment. Rounds are paired: each round runs every mode once, back to back
(the order rotated from round to round), so that load from elsewhere, which swings one run by
tens of percent on a shared machine, falls on the modes of a round alike. Each mode reports its
median over the rounds with its spread (lowest and highest); each ratio between modes is taken
within each round, then given as its median and spread, and stated as a figure only when that
spread is at most ``RATIO_SPREAD`` (else "unresolved", with its range: more rounds or a quieter
machine resolve it). ``--rounds`` defaults to 5; ``--quick`` runs 2 rounds of a shorter workload
(the quick demo with short replies, ``QUICK_E2E``) in under 4 minutes.

Runs (same workload, same capacities, fresh LMDB store each):

- ``recompute_device_only``: recompute as vLLM v1 does it: prefix reuse from the device tier only
  (``host_blocks 0``, no storage tier);
- ``recompute``: the best recompute, beside the same host and storage tiers as the other modes
  (FastDeploy's way: re-admission swaps the victim's cached blocks back in, only the rest recomputes);
- ``offload``, ``storage``, ``auto``: fastkv's preemption modes, with the same tiers.

The synthetic runner waits out (a GPU computes: no host CPU) the step time of ``--cost-model``
(``fastkv.deploy.cost_model``: a roofline of Llama-3-8B on an H100 SXM, scaled so that
compute per token against this machine's copy time per token of KV is the deployment's compute
against its PCIe copy). The copy bandwidth
it scales by is measured once here and given to every run, so that all runs simulate the same
compute. Under a cost model the KV layout defaults to 32 KiB per token (``MODEL_LAYOUT``), so that
modelled steps outweigh the engine's own Python per step. ``--cost-model flat`` keeps the runner's
flat 300 us per token and the supervisor's layout.

Tokens/s are generated tokens over the run's wall time to its last token (``last_token_s``: the
STOREs still draining after it delay no token; ``seconds`` in the table is the whole run) less the
synthetic runner's own byte work
(``synthetic_us``: making, checking and reading its KV rows), which stands for work the GPU does
inside the modelled step time and which the runner does before waiting that time out. On this CPU
it costs more than the model: making a 32 KiB token's rows (compiled, ``fastkv.native._synthetic``) about
a prefill token in a long prefill, with ~1 ms of Python per decode step on top; checking a resumed
prefix twice that. (In numpy the rows cost 15-20x a prefill token and made two-thirds of the
walls.) Left in the time, it charged recompute and resuming at this CPU's rates, not the
deployment's. The table shows both figures.

Prints tokens/s, recomputed tokens, time to first token, hit ratio per tier, preemptions, step
and copy task p50 per run, what preempting costs under the model (``preemption_costs``: recompute
and copy per token, and how many recomputed tokens ride on a decode step for free), then, as the
LAST line:

    {"bench": "e2e", "cost_model": NAME, "copy_gbps": ..., "tokens_per_s": {"recompute_device_only": ...,
     "recompute": ..., "offload": ..., "storage": ..., "auto": ...}, "recomputed_tokens": {...same keys},
     "outputs_identical": true|false, "outputs_correct": true|false|null, "verified": {...same keys}}

with ``outputs_identical`` over every run of every round: every request finished
with the same tokens whatever the preemption mode and tiers; ``outputs_correct``: with the
synthetic runner, every run's outputs equal the synthetic model's, computed from the prompts
without any cache (its next token depends on the KV it reads, so wrong KV shows here); null
with another runner. ``--quick``: the quick demo. ``--workload``: another workload (as
fastkv-supervisor's ``--workload``), or ``mixed``: short and long contexts side by side, where
the cheaper way to preempt differs between requests (``mixed_workload``): what auto is for.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import tempfile
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.cli import (  # noqa: E402
    CACHE_POLICIES,
    RUNNER_VOCAB,
    STORAGE_WRITES,
    JobConfig,
    at_least,
    parse_entries,
    prepare,
    report,  # noqa: E402
)
from fastkv.cli.supervisor import Supervisor  # noqa: E402
from fastkv.config import KV_CACHE_DTYPES, QUANT_DTYPES  # noqa: E402
from fastkv.deploy.cost_model import (  # noqa: E402
    DEPLOYMENTS,
    LLAMA3_8B_H100,
    calibrate_for,
    deployment,
    measure_copy_bandwidth,
)
from fastkv.procs.cpu_policy import CPU_POLICIES  # noqa: E402
from fastkv.workload import read_workload, write_workload  # noqa: E402

# --quick: the quick demo's 8 conversations x 3 turns with short replies: the prompts alone
# outgrow the demo's device tier, so every mode still preempts, in a few seconds a run. Each run
# also costs ~10 s of start-up and teardown (three processes importing Paddle), so two rounds.
QUICK_E2E = {"max_new_tokens": 32}
QUICK_ROUNDS = 2
RATIO_SPREAD = 0.06  # a ratio whose rounds differ by more cannot tell a few percent apart
SMOKE_DEMO = {"conversations": 2, "turns": 2, "system_tokens": 32, "user_tokens": (8, 16), "reply_tokens": 8,
              "max_new_tokens": 16}

# label (the JSON key) -> (preemption mode, host and storage tiers on)
RUNS = {"recompute_device_only": ("recompute", False), "recompute": ("recompute", True),
        "offload": ("offload", True), "storage": ("storage", True), "auto": ("auto", True)}


# Under a cost model, every workload's KV is a quarter of Llama-3-8B's bytes per token (16 layers x
# 8 KV heads x 64 in bfloat16, 32 KiB), so that the model's compute, scaled to it, outweighs this
# machine's per-step Python. With the supervisor's 4 KiB a decode step is modelled at about the
# engine's own step time (0.36 ms on a machine copying at 30 GB/s), and the modes were ranked by
# their bookkeeping: offload / recompute_device_only read 0.997 on --quick there, 1.09 with 32 KiB.
MODEL_LAYOUT = {"layers": 16, "kv_heads": 8, "dtype": "bfloat16"}
# --workload mixed: tiers that hold the long contexts of two requests (device) and a bit more (host).
MIXED = {**MODEL_LAYOUT, "device_blocks": 200, "host_blocks": 256}


def run_defaults(workload: str, modelled: bool) -> dict:
    """The layout and tiers every run gets where no flag names them: the cost model's layout
    (``modelled``), the mixed workload's tiers, else the supervisor's own defaults."""
    defaults = {**(MODEL_LAYOUT if modelled else {}), **(MIXED if workload == "mixed" else {})}
    return {name: defaults.get(name, getattr(JobConfig, name)) for name in MIXED}


def mixed_workload(path: Path, seed: int = 0) -> Path:
    """Requests with no shared prefix: 20 short ones (16-40 prompt tokens, 256 generated) and,
    arriving just after them, 4 long ones (1400-1600 prompt tokens, 32 generated). As the short
    ones grow, the scheduler preempts the newest request: first the long ones, each holding ~1500
    computed tokens (recomputing one costs ~0.1 s of modelled compute, copying it a few ms), then
    short ones holding 50-300 tokens (which a decode step recomputes nearly for free). The right
    way to preempt differs between them: what auto is for."""
    rng = random.Random(seed)
    reqs = []
    for i in range(24):
        long = i >= 20
        n = rng.randint(1400, 1600) if long else rng.randint(16, 40)
        reqs.append({"id": f"{'long' if long else 'short'}{i:02d}", "arrival_s": round(i * 1e-4 + 0.01 * long, 4),
                     "prompt": [rng.randrange(1, RUNNER_VOCAB) for _ in range(n)],
                     "max_new_tokens": 32 if long else 256})
    return write_workload(reqs, path)


SYNC = "/sync"  # a label's suffix: the run with --async-scheduling off
# A label's suffix under a quantized --kv-cache-dtype: the same run with bfloat16 KV, to compare with.
BF16 = "@bfloat16"


def run_config(base: JobConfig, label: str, out: Path) -> JobConfig:
    """The job of run ``label``: the base settings, its preemption mode and its tiers."""
    mode, host = RUNS[label.removesuffix(SYNC).removesuffix(BF16)]
    kv = {"kv_cache_dtype": "auto", "dtype": "bfloat16"} if label.endswith(BF16) else {}
    try:
        return dataclasses.replace(base, **{**kv, "preemption": mode, "async_scheduling": "off" if label.endswith(SYNC)
                                            else base.async_scheduling, "host_blocks": base.host_blocks if host else 0,
                                            "storage": base.storage if host else "none",
                                            "storage_write": base.storage_write if host else JobConfig.storage_write,
                                            "out": str(out)})
    except ValueError as exc:
        raise ValueError(f"run {label!r}: {exc}") from None


def run_one(base: JobConfig, label: str, out: Path, entries: dict[str, str]) -> dict:
    spec, workload = prepare(run_config(base, label, out))
    result = Supervisor(spec, workload, entry_points=entries).run()
    if not result.ok:
        raise SystemExit(f"bench_e2e: run {label!r} failed: {result.message}")
    data = report.build(report.load_summary(out), report.load_results(out))  # no plot: seconds per run
    # The run as the cost model times it: without the runner's own byte work (module docstring).
    # Ranks do theirs side by side: their mean is the delay.
    data["wall_tokens_per_s"] = data["tokens_per_s"]
    modelled = spec.runner_options.get("cost_model")  # the flat cost already counts it: CPU time per token
    data["synthetic_s"] = data.get("verified", {}).get("synthetic_us", 0) / 1e6 / spec.tp_size if modelled else 0.0
    # To the last token: what a tier's write-behind copies take to drain after it delays no token.
    data["tokens_per_s"] = data["generated_tokens"] / max(data.get("last_token_s", data["seconds"])
                                                          - data["synthetic_s"], 1e-9)
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


def spread(values: list[float], digits: int = 1) -> dict[str, float]:
    """Median, lowest and highest of a figure over the rounds."""
    v = sorted(values)
    mid = v[len(v) // 2] if len(v) % 2 else (v[len(v) // 2 - 1] + v[len(v) // 2]) / 2
    return {"median": round(mid, digits), "min": round(v[0], digits), "max": round(v[-1], digits)}


def fmt_spread(v: dict[str, float], digits: int) -> str:
    return f"{v['median']:.{digits}f} ({v['min']:.{digits}f}-{v['max']:.{digits}f})"


def paired_ratios(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per round: every tiered mode against recompute_device_only, offload against recompute
    and against the round's best mode, auto against the round's best fixed mode; then each
    ratio's median and spread, and whether the spread resolves it (``RATIO_SPREAD``)."""
    rounds = len(next(iter(runs.values())))
    per: dict[str, list[float]] = {}
    suffixes = [x for x in ("", SYNC) if f"recompute_device_only{x}" in runs]
    for r in range(rounds):
        for x in suffixes:  # async and sync runs each against their own kind
            t = {m: runs[m + x][r]["tokens_per_s"] for m in RUNS}
            pairs = {f"{m}/recompute_device_only": (t[m], t["recompute_device_only"])
                     for m in ("recompute", "offload", "storage", "auto")}
            pairs["offload/recompute"] = (t["offload"], t["recompute"])
            pairs["offload/best"] = (t["offload"], max(t.values()))
            pairs["auto/best_fixed"] = (t["auto"], max(v for m, v in t.items() if m != "auto"))
            for name, (a, b) in pairs.items():
                per.setdefault(name + x, []).append(a / max(b, 1e-9))
        if len(suffixes) == 2:
            for m in RUNS:
                per.setdefault(f"{m}: async/sync", []).append(
                    runs[m][r]["tokens_per_s"] / max(runs[m + SYNC][r]["tokens_per_s"], 1e-9))
        if "offload" + BF16 in runs:  # the quantized KV's offload against bfloat16's, same round
            per.setdefault(f"offload/offload{BF16}", []).append(
                runs["offload"][r]["tokens_per_s"] / max(runs["offload" + BF16][r]["tokens_per_s"], 1e-9))
    out = {}
    for name, values in per.items():
        s = spread(values, 3)
        out[name] = {**s, "resolved": s["max"] - s["min"] <= RATIO_SPREAD}
    return out


def fmt_ratio(r: dict) -> str:
    rng = f"{r['min']:.3f}-{r['max']:.3f}"
    return f"{r['median']:.3f} ({rng})" if r["resolved"] else f"unresolved ({rng})"


def fmt_row(label: str, d: dict) -> str:
    ttft, hit, pre = d["ttft_s"], d["hit_ratio"], d["preemptions"]
    ms = lambda k: f"{1e3 * ttft[k]:.0f}" if k in ttft else "-"  # noqa: E731
    return (f"| {label} | {d['tokens_per_s']:.1f} | {d['wall_tokens_per_s']:.1f} | {d['synthetic_s']:.2f} | "
            f"{d['recomputed_tokens']} | {ms('p50')} | {ms('p99')} | "
            f"{100 * hit['device']:.1f}/{100 * hit['host']:.1f}/{100 * hit['storage']:.1f} | "
            f"{pre['recompute']}/{pre['offload']}/{pre['storage']} | {d['step_ms_p50']:.2f} | {d['task_ms_p50']:.2f} | "
            f"{d['seconds']:.1f} | {gpu_cells(d)} | {d.get('storage_blocks_stored', 0)}/"
            f"{d.get('storage_blocks_skipped', 0)} |")


def gpu_cells(d: dict) -> str:
    t = d.get("gpu_time") or {}
    if d.get("gpu_busy") is None:
        return "- | -"
    return (f"{d['gpu_busy']:.3f} | " + "/".join(f"{t.get(k, 0):.2f}" for k in ("schedule", "copies", "ipc", "idle",
                                                                                  "other")))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="the quick demo workload")
    p.add_argument("--smoke", action="store_true",
                    help="2 conversations x 2 short turns (tests: numbers mean nothing)")
    p.add_argument("--runner", choices=("synthetic", "tiny"), default="synthetic")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--layers", type=int,
                   help="layers of the KV cache: with --kv-heads, the KV bytes per token, which scale the "
                   f"cost model's step time (the cost model keeps compute / copy time per token) (default "
                   f"{MODEL_LAYOUT['layers']}; {JobConfig.layers} with --cost-model flat)")
    p.add_argument("--kv-heads", type=int, help=f"KV heads per rank (default {MODEL_LAYOUT['kv_heads']}; "
                   f"{JobConfig.kv_heads} with --cost-model flat)")
    p.add_argument("--dtype", help=f"KV dtype (default {MODEL_LAYOUT['dtype']}; {JobConfig.dtype} with --cost-model "
                   "flat)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="as fastkv-supervisor (default auto: --dtype); fp8_e4m3 or int8 also runs offload with "
                   f"bfloat16 KV in each round (offload{BF16}), and reports the ratio")
    p.add_argument("--device-blocks", type=int, help="default: the supervisor's for the workload; "
                   f"{MIXED['device_blocks']} with --workload mixed")
    p.add_argument("--host-blocks", type=int, help=f"default {JobConfig.host_blocks}; "
                   f"{MIXED['host_blocks']} with --workload mixed")
    p.add_argument("--cache-policy", choices=CACHE_POLICIES, default=JobConfig.cache_policy,
                   help=f"when blocks get a host copy, in every run (default {JobConfig.cache_policy})")
    p.add_argument("--storage", default="default", help="storage URL for every run (default: fresh LMDB per run)")
    p.add_argument("--storage-write", choices=STORAGE_WRITES, default=JobConfig.storage_write,
                   help=f"what reaches the storage tier, in every run with one (default {JobConfig.storage_write})")
    p.add_argument("--cost-model", default=LLAMA3_8B_H100.name, choices=[*DEPLOYMENTS, "flat"],
                   help="the deployment the synthetic runner simulates (flat: 300 us per token)")
    p.add_argument("--copy-gbps", type=at_least(0.0, float), default=0.0,
                   help="this machine's copy bandwidth (0: measure it)")
    p.add_argument("--verify", choices=("all", "resumed", "off"),
                   help="what the synthetic runner checks byte for byte besides its oracle (default: resumed)")
    p.add_argument("--workload", default="demo", help="as fastkv-supervisor's --workload, or mixed (short "
                   "against long contexts)")
    p.add_argument("--rounds", type=at_least(0), default=0,
                   help=f"paired rounds of every run; each mode reports its median and spread (default 5, "
                   f"--quick {QUICK_ROUNDS}, --smoke 1)")
    p.add_argument("--out", help="keep each run's output here (default: a temporary directory, removed)")
    p.add_argument("--entry", action="append", default=[], metavar="ROLE=MODULE:FUNC", help="as fastkv-supervisor")
    p.add_argument("--async-scheduling", choices=("on", "off", "both"), default="on",
                   help=f"the engine's async scheduling in every run; both: each mode also runs with it off "
                   f"(labelled MODE{SYNC}), interleaved (default on)")
    p.add_argument("--engine-cpu-policy", choices=CPU_POLICIES, default="batch",
                   help="as fastkv-supervisor (default batch)")
    args = p.parse_args()
    if args.verify and args.runner != "synthetic":
        p.error(f"--verify is the synthetic runner's; --runner {args.runner} has no byte checks to set")
    modelled = args.runner == "synthetic" and args.cost_model != "flat"
    if args.kv_cache_dtype != "auto":
        if args.dtype is not None:
            raise SystemExit("bench_e2e: give the KV dtype as --dtype or as --kv-cache-dtype, not both")
        args.dtype = JobConfig.dtype  # the layout is --kv-cache-dtype's
    for name, value in run_defaults(args.workload, modelled).items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    warnings.filterwarnings("ignore", message="No ccache found")
    try:
        entries = parse_entries(args.entry)
    except ValueError as exc:
        p.error(str(exc))
    options: dict = {}
    if modelled:
        gbps = args.copy_gbps or round(measure_copy_bandwidth() / 1e9, 2)
        options = {"cost_model": args.cost_model, "copy_gbps": gbps}
    if args.verify:
        options["verify"] = args.verify
    rounds = args.rounds or (1 if args.smoke else QUICK_ROUNDS if args.quick else 5)
    labels = [*RUNS, *(label + SYNC for label in RUNS)] if args.async_scheduling == "both" else list(RUNS)
    if args.kv_cache_dtype in QUANT_DTYPES:
        labels.append("offload" + BF16)
    runs: dict[str, list[dict]] = {label: [] for label in labels}
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fastkv-bench-e2e-"))
    try:
        workload = str(mixed_workload(root / "mixed.jsonl")) if args.workload == "mixed" else args.workload
        try:  # bad settings: one line naming the setting, as fastkv-supervisor says it
            base = JobConfig(runner=args.runner, tp=args.tp, layers=args.layers, kv_heads=args.kv_heads,
                             dtype=args.dtype, kv_cache_dtype=args.kv_cache_dtype, device_blocks=args.device_blocks,
                             host_blocks=args.host_blocks,
                             cache_policy=args.cache_policy, storage=args.storage, storage_write=args.storage_write,
                             quick=args.quick or args.smoke,
                             async_scheduling="off" if args.async_scheduling == "off" else "on",
                             engine_cpu_policy=args.engine_cpu_policy,
                             demo=SMOKE_DEMO if args.smoke else QUICK_E2E if args.quick else {}, workload=workload,
                             runner_options=options)
            num_requests, block_bytes = len(base.requests()), base.layout().block_bytes
            for label in labels:  # each run's own settings too, before any of them runs
                run_config(base, label, root / label)
        except (ValueError, OSError) as exc:
            raise SystemExit(f"bench_e2e: {exc}") from None
        print(f"{args.workload} workload: {num_requests} requests; {args.runner} runner, tp {args.tp}, "
              f"{base.device_blocks} device / {args.host_blocks} host blocks per rank of "
              f"{block_bytes >> 10} KiB; cost model "
              f"{options.get('cost_model', 'flat')} at {options.get('copy_gbps', '-')} GB/s of copies here",
              flush=True)
        order = list(labels)
        for r in range(rounds):  # paired: every mode once per round, the order rotated
            for label in order[r % len(order):] + order[:r % len(order)]:
                print(f"running {label} (round {r + 1} of {rounds}) ...", flush=True)
                runs[label].append(run_one(base, label, root / f"{label}.{r}", entries))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    # Each mode's median round stands for it in the table; the spread says how far to trust it.
    results = {label: sorted(ds, key=lambda d: d["tokens_per_s"])[(len(ds) - 1) // 2] for label, ds in runs.items()}
    tps = {m: spread([d["tokens_per_s"] for d in ds]) for m, ds in runs.items()}
    print(f"\n{rounds} paired rounds; tokens/s median (lowest-highest): "
          + "; ".join(f"{m} {fmt_spread(v, 0)}" for m, v in tps.items()))
    print("\nEach row is the run's median round (the slower of two).")
    print("\n| run | tokens/s | tokens/s of the wall | runner's byte work s | recomputed tokens | TTFT p50 ms "
          "| TTFT p99 ms | hit % device/host/storage "
          "| preemptions recompute/offload/storage | step p50 ms | copy task p50 ms | seconds | gpu_busy "
          "| GPU idle s: schedule/copies/ipc/idle/other | storage blocks stored/skipped |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for label, d in results.items():
        print(fmt_row(label, d))
    every_run = [d for ds in runs.values() for d in ds]
    # (the synthetic model's tokens depend on the KV dtype: the bfloat16 run is checked alone, below)
    outputs = [d["outputs"] for label, ds in runs.items() if not label.endswith(BF16) for d in ds]
    finished = all(finish in ("length", "stop") for finish, _ in outputs[0].values())
    identical = finished and all(o == outputs[0] for o in outputs)
    correct = [d.get("outputs_correct") for d in every_run]
    correct = None if None in correct else all(correct)
    if options:  # what preempting costs under the model, beside what the copy path costs here
        layout = base.layout()
        costs = {k: round(v, 2) for k, v in calibrate_for(
            deployment(options["cost_model"]), layout, options["copy_gbps"] * 1e9).preemption_costs().items()}
        print(f"\nKV {layout.kv_cache_dtype}: {layout.bytes_per_token} bytes per token per rank")
        print(f"\nunder {options['cost_model']} here: recompute {costs['recompute_us_per_token']} us per token, "
              f"copy {costs['copy_us_per_token']} us per token each way; a decode step of 16 x 1024 tokens "
              f"{costs['decode_step_us']:.0f} us carries {costs['free_recompute_tokens']:.0f} recomputed tokens "
              f"at < 5 % extra (decode bound: recompute nearly free); a copy task costs the table's p50 whatever "
              f"its size")
    ratios = paired_ratios(runs)
    print("\nratios within each round, median (lowest-highest), stated where the spread is at most "
          f"{RATIO_SPREAD}: " + "; ".join(f"{name} {fmt_ratio(r)}" for name, r in ratios.items())
          + f"; outputs identical across runs: {identical}; equal to the synthetic model's (computed without a "
          f"cache): {correct}")
    print(json.dumps({
        "bench": "e2e",
        "cost_model": options.get("cost_model", "flat"),
        "copy_gbps": options.get("copy_gbps", 0.0),
        "rounds": rounds,
        "tokens_per_s": {m: v["median"] for m, v in tps.items()},
        "tokens_per_s_spread": {m: {"min": v["min"], "max": v["max"]} for m, v in tps.items()},
        "ratios": ratios,
        "gpu_busy": {m: spread([d.get("gpu_busy") or 0.0 for d in ds], 3) for m, ds in runs.items()},
        "recomputed_tokens": {m: max(d["recomputed_tokens"] for d in ds) for m, ds in runs.items()},
        # steps sent while the one before ran, the steps' wall time and the workers' (modelled) time
        "async_scheduling": {m: d.get("async_scheduling") for m, d in results.items()},
        "engine_cpu_policy": {m: d.get("engine_cpu_policy") for m, d in results.items()},
        "outputs_identical": identical,
        "outputs_correct": correct,
        "verified": {m: d.get("verified") for m, d in results.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

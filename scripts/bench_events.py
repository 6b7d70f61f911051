#!/usr/bin/env python
"""What KV events cost the engine: the same workload through the whole system (supervisor,
engine, workers, transfer processes) with events off and on, in one invocation, rounds
interleaved; each run reports its fastest round (as bench_e2e: load from elsewhere only slows).

Runs:

- ``off``: no KV events;
- ``on``: events published, a reference indexer (fastkv.routing.indexer, in a process of its
  own) applying every batch; it must end with every batch the engine published;
- ``stalled``: events published to a subscriber that connects and never reads: ZMQ's
  high-water mark bounds what queues for it, the replay buffer bounds what the engine keeps,
  and the engine must not slow down.

Reported per run: tokens/s, step p50, and for the event runs the engine thread's own time
publishing (``flush_us_mean`` per step: taking the cache's residency changes, building and
encoding the batch, handing it to ZMQ) against the run's step p50 (``publish_per_step``: what
publishing adds to a typical step) and as a share of the run's wall time (``publish_share``),
batches, batches ZMQ refused (``dropped``; what the stalled subscriber's queue drops happens in
ZMQ, silently to the engine, and shows as holes at the subscriber), and the replay buffer's
size. The LAST line is JSON:

    {"bench": "events", "workload": W, "tokens_per_s": {"off": ..., "on": ..., "stalled": ...},
     "step_ms_p50": {...same keys}, "publish_per_step": {"on": ..., "stalled": ...},
     "publish_share": {"on": ..., "stalled": ...},
     "flush_us_mean": {"on": ..., "stalled": ...}, "batches": {"on": ..., "stalled": ...},
     "dropped": {"on": ..., "stalled": ...}, "buffered_bytes": {"on": ..., "stalled": ...},
     "reader_complete": true|false}

``--quick``: 32 trace requests and 2 rounds; ``--smoke``: a tiny demo, 1 round (tests).
"""
from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastkv.cli import JobConfig, at_least, prepare  # noqa: E402
from fastkv.supervisor import Supervisor  # noqa: E402

SMOKE_DEMO = {"conversations": 2, "turns": 2, "system_tokens": 32, "user_tokens": (8, 16), "reply_tokens": 8,
              "max_new_tokens": 16}
RUNS = ("off", "on", "stalled")


def reader(endpoint: str, out: str) -> int:
    """--reader: apply every batch until SIGTERM, then write what was applied to ``out``."""
    from fastkv.routing.indexer import Indexer

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    idx = Indexer()
    view = idx.add("engine", endpoint)
    Path(out + ".ready").touch()
    while not stop:
        idx.poll(0.1)
    idx.poll(0.5)
    Path(out).write_text(json.dumps({"batches": view.batches, "next_seq": view.next_seq, "gaps": view.gaps,
                                     "lost": view.lost, "held": {m: len(k) for m, k in view.held.items()}}))
    idx.close()
    return 0


def run_one(base: JobConfig, label: str, out: Path) -> dict:
    endpoint = f"ipc://{out.parent}/{label}.pub"
    kw = {} if label == "off" else {"kv_events_endpoint": endpoint}
    cfg = JobConfig(**{**base.__dict__, **kw, "out": str(out)})
    spec, workload = prepare(cfg)
    proc = sub = ctx = None
    if label == "on":
        got = out.parent / f"{label}.reader.json"
        got.unlink(missing_ok=True)
        proc = subprocess.Popen([sys.executable, __file__, "--reader", endpoint, str(got)])
        ready = Path(str(got) + ".ready")
        while not ready.exists() and proc.poll() is None:
            try:
                proc.wait(0.05)
            except subprocess.TimeoutExpired:
                pass
    elif label == "stalled":
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.rcvhwm = 16
        sub.connect(endpoint)  # and never reads
    try:
        result = Supervisor(spec, workload).run()
    finally:
        if proc is not None:
            proc.send_signal(signal.SIGTERM)
            proc.wait(30)
        if ctx is not None:
            ctx.destroy(linger=0)
    if not result.ok:
        raise SystemExit(f"bench_events: run {label!r} failed: {result.message}")
    data = json.loads((out / "summary.json").read_text())
    ev = data.get("kv_events") or {}
    if ev:
        ev["publish_share"] = ev["flushes"] * ev["flush_us_mean"] / 1e6 / max(data["seconds"], 1e-9)
        ev["publish_per_step"] = ev["flush_us_mean"] / 1e3 / max(data["step_ms_p50"], 1e-9)
    if label == "on":
        data["reader"] = json.loads(got.read_text())
    return data


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--reader":
        return reader(sys.argv[2], sys.argv[3])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="32 trace requests, 2 rounds")
    p.add_argument("--smoke", action="store_true", help="a tiny demo, 1 round (tests: numbers mean nothing)")
    p.add_argument("--workload", help="as fastkv-supervisor's --workload (default trace:64; --quick trace:32)")
    p.add_argument("--rounds", type=at_least(1), help="rounds of every run, interleaved (default 3, --quick 2, "
                   "--smoke 1)")
    p.add_argument("--out", help="keep each run's output here (default: a temporary directory, removed)")
    args = p.parse_args()
    warnings.filterwarnings("ignore", message="No ccache found")
    workload = args.workload or ("demo" if args.smoke else "trace:32" if args.quick else "trace:64")
    rounds = args.rounds or (1 if args.smoke else 2 if args.quick else 3)
    root = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="fastkv-bench-events-"))
    root.mkdir(parents=True, exist_ok=True)
    runs: dict[str, list[dict]] = {label: [] for label in RUNS}
    try:
        try:
            base = JobConfig(workload=workload, quick=args.smoke, demo=SMOKE_DEMO if args.smoke else {})
            n = len(base.requests())
        except (ValueError, OSError) as exc:
            raise SystemExit(f"bench_events: {exc}") from None
        print(f"{workload}: {n} requests, {base.device_blocks} device / {base.host_blocks} host blocks; "
              f"{rounds} interleaved rounds of {', '.join(RUNS)}", flush=True)
        for r in range(rounds):
            for label in RUNS:
                print(f"running {label} (round {r + 1} of {rounds}) ...", flush=True)
                runs[label].append(run_one(base, label, root / f"{label}.{r}"))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    best = {label: max(ds, key=lambda d: d["tokens_per_s"]) for label, ds in runs.items()}
    per_round = "; ".join(f"{m} " + ", ".join(str(round(d["tokens_per_s"])) for d in ds) for m, ds in runs.items())
    print(f"\nfastest of {rounds} interleaved rounds per run; tokens/s of every round: {per_round}")
    print("\n| run | tokens/s | / off | step p50 ms | publish us per step | / step p50 % | publish share of wall % "
          "| batches | dropped | replay buffer KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    off = best["off"]["tokens_per_s"]
    for label, d in best.items():
        ev = d.get("kv_events") or {}
        cells = ([f"{ev['flush_us_mean']:.1f}", f"{100 * ev['publish_per_step']:.2f}",
                  f"{100 * ev['publish_share']:.3f}", str(ev["batches"]), str(ev["dropped"]),
                  f"{ev['buffered_bytes'] / 1024:.0f}"] if ev else ["-"] * 6)
        print(f"| {label} | {d['tokens_per_s']:.1f} | {d['tokens_per_s'] / max(off, 1e-9):.3f} | "
              f"{d['step_ms_p50']:.2f} | " + " | ".join(cells) + " |")
    rd = [d["reader"] for d in runs["on"]]
    complete = all(r["next_seq"] == d["kv_events"]["batches"] and r["lost"] == 0 for r, d in zip(rd, runs["on"],
                                                                                                  strict=True))
    print(f"\nreader applied every batch of every 'on' run: {complete} "
          f"({', '.join(str(r['batches']) for r in rd)} batches)")
    ev = {m: best[m]["kv_events"] for m in ("on", "stalled")}
    print(json.dumps({
        "bench": "events",
        "workload": workload,
        "tokens_per_s": {m: round(d["tokens_per_s"], 1) for m, d in best.items()},
        "step_ms_p50": {m: round(d["step_ms_p50"], 3) for m, d in best.items()},
        "publish_per_step": {m: round(e["publish_per_step"], 5) for m, e in ev.items()},
        "publish_share": {m: round(e["publish_share"], 5) for m, e in ev.items()},
        "flush_us_mean": {m: e["flush_us_mean"] for m, e in ev.items()},
        "batches": {m: e["batches"] for m, e in ev.items()},
        "dropped": {m: e["dropped"] for m, e in ev.items()},
        "buffered_bytes": {m: e["buffered_bytes"] for m, e in ev.items()},
        "reader_complete": complete,
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

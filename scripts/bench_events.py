#!/usr/bin/env python
"""What KV events cost the engine: the same workload through the whole system (supervisor,
engine, workers, transfer processes) with events off and on, in one invocation, rounds
interleaved (each round in another order of the runs).

Runs:

- ``off``: no KV events;
- ``on``: events published, a reference indexer (fastkv.routing.indexer, in a process of its
  own) applying every batch; it must end with every batch the engine published;
- ``stalled``: the same, and beside it a subscriber that connects and never reads, with a ZMQ
  high-water mark of ``STALLED_HWM`` batches so that its queue fills within the run: the
  publisher must count the batches it could not take (``dropped``, in the summary) and set the
  stalled queue aside, the reader must end with every batch (it replays the holes), the replay
  buffer bounds what the engine keeps, and the engine must not slow down.

The reader process runs in ``off`` too (subscribed to an endpoint nobody publishes on), so that
the runs differ only in what the engine does.

Step time is noisy on a shared machine, so each round compares its runs with each other: per
round the ratio of step p50 (and of tokens/s) to that round's ``off`` run; reported are the
median of the rounds' ratios and their spread (min..max). Also per event run: the engine
thread's CPU time per flush (``flush_cpu_us_mean``: taking the cache's residency changes and
handing them to the publisher thread) against the run's step p50 (``publish_per_step``), the
publisher thread's CPU time per batch (building, encoding, sending: off the step's path),
batches, ``dropped`` and ``set_aside`` per round, and the replay buffer's size. The LAST line is JSON:

    {"bench": "events", "workload": W,
     "tokens_per_s": {"off": ..., "on": ..., "stalled": ..., "ratio": {"on": {"median": .., "min": ..,
                      "max": ..}, "stalled": {...}}},
     "step_ms_p50": {...the same shape},
     "publish_per_step": {"on": ..., "stalled": ...}, "publish_share": {...: engine-thread CPU / wall},
     "flush_us_mean": {"on": wall, "stalled": wall, "cpu": {...}, "publisher_cpu_per_batch": {...}},
     "batches": {...}, "dropped": {"on": n, "stalled": n, "set_aside": {...}} (summed over rounds),
     "buffered_bytes": {...}, "reader_complete": true|false}

(medians over rounds for the per-run figures). ``--quick``: 32 trace requests and 2 rounds;
``--smoke``: a tiny demo, 1 round (tests).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastkv.cli import JobConfig, at_least, prepare  # noqa: E402
from fastkv.cli.supervisor import Supervisor  # noqa: E402

SMOKE_DEMO = {"conversations": 2, "turns": 2, "system_tokens": 32, "user_tokens": (8, 16), "reply_tokens": 8,
              "max_new_tokens": 16}
RUNS = ("off", "on", "stalled")
STALLED_HWM = 16  # batches queued for the stalled subscriber before the publisher drops


def reader(endpoint: str, replay: str, out: str) -> int:
    """--reader: apply every batch until SIGTERM (a hole: replay it), then write what was
    applied to ``out``."""
    from fastkv.routing.indexer import Indexer

    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    idx = Indexer()
    view = idx.add("engine", endpoint, replay)
    Path(out + ".ready").touch()
    timeouts = 0
    while not stop:
        try:
            idx.poll(0.1)
        except TimeoutError:  # the engine is gone before it answered a replay
            timeouts += 1
    with contextlib.suppress(TimeoutError):
        idx.poll(0.5)
    Path(out).write_text(json.dumps({"batches": view.batches, "next_seq": view.next_seq, "gaps": view.gaps,
                                     "lost": view.lost, "replay_timeouts": timeouts,
                                     "held": {m: len(k) for m, k in view.held.items()}}))
    idx.close()
    return 0


def run_one(base: JobConfig, label: str, out: Path) -> dict:
    """One run; a reader process subscribes in every run (in ``off`` to an endpoint nobody
    publishes on), so that the runs differ only in what the engine does."""
    endpoint, replay = f"ipc://{out.parent}/{label}.pub", f"ipc://{out.parent}/{label}.replay"
    kw = {} if label == "off" else {"kv_events_endpoint": endpoint, "kv_events_replay_endpoint": replay}
    cfg = dataclasses.replace(base, **kw, out=str(out))
    spec, workload = prepare(cfg)
    if label == "stalled":
        spec = dataclasses.replace(spec, kv_events={**spec.kv_events, "hwm": STALLED_HWM})
    got = out.parent / f"{label}.reader.json"
    got.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, __file__, "--reader", endpoint, replay, str(got)])
    ready = Path(str(got) + ".ready")
    while not ready.exists() and proc.poll() is None:
        try:
            proc.wait(0.05)
        except subprocess.TimeoutExpired:
            pass
    ctx = None
    if label == "stalled":
        import zmq

        ctx = zmq.Context()
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.rcvhwm = STALLED_HWM
        sub.connect(endpoint)  # and never reads
    try:
        result = Supervisor(spec, workload).run()
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)
        if ctx is not None:
            ctx.destroy(linger=0)
    if not result.ok:
        raise SystemExit(f"bench_events: run {label!r} failed: {result.message}")
    data = json.loads((out / "summary.json").read_text())
    ev = data.get("kv_events") or {}
    if ev:
        ev["publish_per_step"] = ev["flush_cpu_us_mean"] / 1e3 / max(data["step_ms_p50"], 1e-9)
        ev["publish_share"] = ev["flushes"] * ev["flush_cpu_us_mean"] / 1e6 / max(data["seconds"], 1e-9)
    data["reader"] = json.loads(got.read_text())
    return data


def spread(values: list[float]) -> dict[str, float]:
    return {"median": round(statistics.median(values), 4), "min": round(min(values), 4), "max": round(max(values), 4)}


def main() -> int:
    if len(sys.argv) == 5 and sys.argv[1] == "--reader":
        return reader(sys.argv[2], sys.argv[3], sys.argv[4])
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
            for label in RUNS[r % len(RUNS):] + RUNS[:r % len(RUNS)]:  # no run always first
                print(f"running {label} (round {r + 1} of {rounds}) ...", flush=True)
                runs[label].append(run_one(base, label, root / f"{label}.{r}"))
    finally:
        if not args.out:
            shutil.rmtree(root, ignore_errors=True)
    med = statistics.median
    ratio = {key: {m: spread([d[key] / max(o[key], 1e-9) for d, o in zip(runs[m], runs["off"], strict=True)])
                   for m in ("on", "stalled")} for key in ("step_ms_p50", "tokens_per_s")}
    ev = {m: [d["kv_events"] for d in runs[m]] for m in ("on", "stalled")}
    print("\nper round (run order rotates): step p50 ms / tokens/s")
    for r in range(rounds):
        print(f"  round {r + 1}: " + "; ".join(f"{m} {runs[m][r]['step_ms_p50']:.2f} / {runs[m][r]['tokens_per_s']:.1f}"
                                          for m in RUNS))
    print("\n| run | step p50 / off: median (min..max) | tokens/s / off: median (min..max) | engine thread CPU us "
          "per flush | / step p50 % | publisher thread CPU us per batch | batches | dropped | set aside "
          "| replay buffer KiB |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for m in ("on", "stalled"):
        st, tk = ratio["step_ms_p50"][m], ratio["tokens_per_s"][m]
        e = ev[m]
        print(f"| {m} | {st['median']:.3f} ({st['min']:.3f}..{st['max']:.3f}) | {tk['median']:.3f} "
              f"({tk['min']:.3f}..{tk['max']:.3f}) | {med([x['flush_cpu_us_mean'] for x in e]):.1f} | "
              f"{100 * med([x['publish_per_step'] for x in e]):.2f} | "
              f"{med([x['encode_cpu_us_mean'] for x in e]):.1f} | "
              f"{med([x['batches'] for x in e]):.0f} | {', '.join(str(x['dropped']) for x in e)} | "
              f"{', '.join(str(x['set_aside']) for x in e)} | "
              f"{max(x['buffered_bytes'] for x in e) / 1024:.0f} |")
    complete = {m: all(d["reader"]["next_seq"] == d["kv_events"]["batches"] and d["reader"]["lost"] == 0
                       for d in runs[m]) for m in ("on", "stalled")}
    print(f"\nthe reader applied every batch of every 'on' run: {complete['on']}; beside the stalled subscriber, "
          f"replaying the holes: {complete['stalled']} (batches, gaps: "
          + "; ".join(f"{m} " + ", ".join(f"{d['reader']['batches']}, {d['reader']['gaps']}" for d in runs[m])
                      for m in ("on", "stalled")) + ")")
    print(json.dumps({  # the keys BENCHMARKS.md shows; what was added since sits inside them
        "bench": "events",
        "workload": workload,
        "tokens_per_s": {**{m: round(med([d["tokens_per_s"] for d in ds]), 1) for m, ds in runs.items()},
                         "ratio": ratio["tokens_per_s"]},
        "step_ms_p50": {**{m: round(med([d["step_ms_p50"] for d in ds]), 3) for m, ds in runs.items()},
                        "ratio": ratio["step_ms_p50"]},
        "publish_per_step": {m: round(med([x["publish_per_step"] for x in e]), 5) for m, e in ev.items()},
        "publish_share": {m: round(med([x["publish_share"] for x in e]), 5) for m, e in ev.items()},
        "flush_us_mean": {**{m: med([x["flush_us_mean"] for x in e]) for m, e in ev.items()},
                          "cpu": {m: med([x["flush_cpu_us_mean"] for x in e]) for m, e in ev.items()},
                          "publisher_cpu_per_batch": {m: med([x["encode_cpu_us_mean"] for x in e])
                                                      for m, e in ev.items()}},
        "batches": {m: med([x["batches"] for x in e]) for m, e in ev.items()},
        "dropped": {**{m: sum(x["dropped"] for x in e) for m, e in ev.items()},
                    "set_aside": {m: sum(x["set_aside"] for x in e) for m, e in ev.items()}},
        "buffered_bytes": {m: max(x["buffered_bytes"] for x in e) for m, e in ev.items()},
        "reader_complete": all(complete.values()),
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Stand-in entry points with the supervisor's protocol (docs/DESIGN.md), to test the supervisor
without the real engine.

Each attaches what its role attaches, writes its pid, ready flag and heartbeat, and exits 0
when ``stop`` is set. The engine reads workload.jsonl and writes results.jsonl and
summary.json in the engine's format; like the real one it binds its channel ends and closes
them when the workload is done, so the workers and transfer processes exit 0 (on
ChannelClosed) a little before the engine itself does. Knobs from ``spec.runner_options``:

- ``standin_request_s``: seconds the engine spends per request (default 0.01);
- ``standin_wait_restart``: the engine finishes only after transfer0 was restarted
  (``transfer0.gen`` >= 1) and the replacement is ready, so a test proves the restart;
- ``standin_worker_exit``: worker0 exits with this code right after it is ready;
- ``standin_transfer_hang``: transfer0 of generation 0 stops beating (a hung process);
- ``standin_linger_s``: the engine's time between closing its channels and exiting (default 0.3).
- ``standin_cleanup_s``: the time workers and transfer processes spend releasing what they
  attached, EXITING, after the engine closed their channels (default 0).
"""
from __future__ import annotations

import json
import os
import threading
import time

from fastkv.ipc import ChannelClosed, Namespace, SignalArray
from fastkv.run import EXITING, READY, RunSpec, attach_engine, attach_transfer, attach_worker
from fastkv.transfer.tiers import HostTier
from fastkv.workload import read_workload

_idle = threading.Event()  # never set: Event.wait(t) is the stand-ins' interruptible pause


def _announce(sig: SignalArray, proc: str) -> None:
    sig[f"{proc}.pid"] = os.getpid()
    sig[f"{proc}.beat"] = time.monotonic_ns()
    sig[f"{proc}.ready"] = READY


def _busy(sig: SignalArray, seconds: float, beat_every: float) -> None:
    """The engine's work on one request: it beats all along, as the real one does between steps
    (beating only once per request would race dead_after_s when a request takes as long)."""
    end = time.monotonic() + seconds
    while True:
        sig["engine.beat"] = time.monotonic_ns()
        left = end - time.monotonic()
        if left <= 0:
            return
        _idle.wait(min(left, beat_every))


def _serve(spec: RunSpec, sig: SignalArray, proc: str, channel, hang: bool = False) -> int:
    try:
        while not sig["stop"]:
            if not hang:
                sig[f"{proc}.beat"] = time.monotonic_ns()
            try:
                channel.recv(timeout=spec.heartbeat_s / 2)
            except ChannelClosed:
                print(f"stand-in {proc}: the engine closed its channel; exiting", flush=True)
                return 0
        return 0
    finally:  # as the real ones: EXITING while releasing what they attached
        sig[f"{proc}.ready"] = EXITING
        cleanup = float(spec.runner_options.get("standin_cleanup_s", 0))
        if cleanup:
            _idle.wait(cleanup)
            print(f"stand-in {proc}: cleaned up", flush=True)


def transfer_main(spec_json: str, rank: int) -> int:
    spec = RunSpec.from_json(spec_json)
    ns = Namespace.attach(spec.run_id)
    ends = attach_transfer(ns, spec, rank)
    hosts = [HostTier.attach(spec.tier_prefix, rank, layout, n, pin=False, group=g)
             for g, layout, n in spec.host_tiers()]
    proc = f"transfer{rank}"
    gen = ends.signals[f"{proc}.gen"]
    _announce(ends.signals, proc)
    hang = bool(spec.runner_options.get("standin_transfer_hang")) and rank == 0 and gen == 0
    try:
        return _serve(spec, ends.signals, proc, ends.task, hang)
    finally:
        for host in hosts:
            host.close()
        ends.close()


def worker_main(spec_json: str, rank: int) -> int:
    spec = RunSpec.from_json(spec_json)
    ns = Namespace.attach(spec.run_id)
    ends = attach_worker(ns, spec, rank)
    proc = f"worker{rank}"
    _announce(ends.signals, proc)
    code = spec.runner_options.get("standin_worker_exit")
    if code is not None and rank == 0:
        print(f"stand-in worker{rank}: exiting with {code} as asked", flush=True)
        return int(code)
    try:
        return _serve(spec, ends.signals, proc, ends.plan)
    finally:
        ends.close()


def engine_main(spec_json: str, workload_path: str) -> int:
    spec = RunSpec.from_json(spec_json)
    ns = Namespace.attach(spec.run_id)
    ends = attach_engine(ns, spec)
    sig = ends.signals
    _announce(sig, "engine")
    opts = spec.runner_options
    per_request = float(opts.get("standin_request_s", 0.01))
    requests = read_workload(workload_path)
    sig["engine.total"] = len(requests)
    t0 = time.monotonic()
    timeline = [[0.0, 0, 0, 0]]
    generated = preempted = 0
    with open(os.path.join(spec.out_dir, "results.jsonl"), "w") as out:
        for i, req in enumerate(requests):
            if sig["stop"]:
                return 0
            _busy(sig, per_request, spec.heartbeat_s / 2)
            output = [(req["prompt"][-1] + j) % 1024 for j in range(req["max_new_tokens"])]
            generated += len(output)
            preempted += i % 3 == 0
            out.write(json.dumps({"id": req["id"], "output": output, "finish": "length",
                                  "ttft_s": 0.001 * (i + 1), "latency_s": 0.002 * (i + 1),
                                  "preemptions": int(i % 3 == 0), "recomputed_tokens": 0}) + "\n")
            sig.add("engine.finished")
            timeline.append([time.monotonic() - t0, i + 1, generated, preempted])
    while opts.get("standin_wait_restart") and not (sig["transfer0.gen"] >= 1 and sig["transfer0.ready"]):
        if sig["stop"]:
            return 0
        sig["engine.beat"] = time.monotonic_ns()
        _idle.wait(spec.heartbeat_s / 2)
    seconds = time.monotonic() - t0
    ends.close()
    _idle.wait(float(opts.get("standin_linger_s", 0.3)))
    summary = {
        "requests": len(requests), "prompt_tokens": sum(len(r["prompt"]) for r in requests),
        "generated_tokens": generated, "seconds": seconds, "tokens_per_s": generated / max(seconds, 1e-9),
        "recomputed_tokens": 0, "preemptions": {"recompute": 0, "offload": preempted, "storage": 0},
        "hit_ratio": {"device": 0.5, "host": 0.2, "storage": 0.05}, "copy_gbps": 1.5, "step_ms_p50": 1.0,
        "step_ms_p99": 3.0, "task_ms_p50": 0.5, "timeline": timeline,
    }
    with open(os.path.join(spec.out_dir, "summary.json"), "w") as f:
        json.dump(summary, f)
    return 0


ENTRIES = [f"--entry={role}=tests.e2e.standins:{role}_main" for role in ("engine", "worker", "transfer")]


def worker_rank1_dies(spec_json: str, rank: int) -> int:
    """The real worker, except rank 1: it exits (code 3) once worker0 is up and has had a
    half a second to enter the step-0 all-gather, where it then waits for rank 1."""
    from fastkv.engine import worker

    if rank != 1:
        return worker.main(spec_json, rank)
    spec = RunSpec.from_json(spec_json)
    sig = SignalArray.attach(Namespace.attach(spec.run_id), "signals")
    sig["worker1.pid"] = os.getpid()
    while not sig["worker0.ready"]:
        _idle.wait(0.05)
    _idle.wait(0.5)
    return 3

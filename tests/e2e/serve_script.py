"""A serving script written from the docs alone, for the signal and death tests (test_embed_signals.py).

``python -m tests.e2e.serve_script OUT [--tp N] [--start-delay S] [--step-ms MS] [--load-s S]
[--die startup|midrun] [--die-rank R] [--updates N]``

It launches a run, starts the toy workers of embed_example.py (each sleeping ``--step-ms`` per
step, ``--start-delay`` before it is ready and ``--load-s`` to load weights), waits until ready,
streams 40 requests, with ``--updates`` weight updates along the way, and prints a line per phase
(``run <id>``, ``phase wait``, ``phase stream``, ``phase update``, ``done``) so that a test can
signal it at the moment it wants. ``--die`` makes worker ``--die-rank`` fail at start-up (before it
attaches) or after 20 steps. The worker's own settings reach it through ``run.start``'s ``args``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
import uuid

from fastkv.config import KVLayout
from fastkv.engine import Engine, EngineError
from fastkv.engine.worker_api import WorkerPort
from fastkv.launch import launch
from fastkv.run import RunSpec
from fastkv.transfer.tiers import DeviceTier
from tests.e2e.embed_example import VOCAB, toy_step


def worker_main(spec_json: str, rank: int, opts_json: str) -> int:
    opts = json.loads(opts_json)
    dies = opts["die"] if opts["die_rank"] == rank else None
    if dies == "startup":
        raise RuntimeError(f"worker {rank} cannot load its model (on purpose) at {time.monotonic():.3f}")
    time.sleep(opts["start_delay"])
    spec = RunSpec.from_json(spec_json)
    port = WorkerPort(spec, rank)
    tier = DeviceTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks)
    history: dict[str, list[int]] = {}
    steps = 0
    port.ready()
    try:
        for plan in port.plans():
            if plan.weights is not None:
                time.sleep(opts["load_s"])
                port.answer(plan)
                continue
            if plan.seqs:
                steps += 1
                if dies == "midrun" and steps == 20:
                    raise RuntimeError(f"worker {rank} lost its device at step {plan.step_id} (on purpose) "
                                       f"at {time.monotonic():.3f}")
                time.sleep(opts["step_ms"] / 1e3)
            port.answer(plan, *toy_step(plan, tier.k_arrays, tier.v_arrays, spec.layout.block_size, history))
            for request_id in plan.release:
                history.pop(request_id, None)
    finally:
        tier.close()
        port.close()
    return 0


def say(what: str) -> None:
    print(what, flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--start-delay", type=float, default=0.0)
    ap.add_argument("--step-ms", type=float, default=5.0)
    ap.add_argument("--load-s", type=float, default=0.0)
    ap.add_argument("--die", choices=("startup", "midrun"))
    ap.add_argument("--die-rank", type=int, default=0)
    ap.add_argument("--updates", type=int, default=0)
    args = ap.parse_args()
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32", tp_size=args.tp)
    spec = RunSpec(f"sv{uuid.uuid4().hex[:10]}", layout, 24, 64, out_dir=args.out, heartbeat_s=0.2, dead_after_s=5.0)
    opts = json.dumps({"die": args.die, "die_rank": args.die_rank, "start_delay": args.start_delay,
                       "step_ms": args.step_ms, "load_s": args.load_s})
    say(f"run {spec.run_id}")
    with launch(spec) as run:
        for rank in range(spec.tp_size):
            run.start("worker", rank, "tests.e2e.serve_script:worker_main", args=(spec.to_json(), rank, opts))
        engine = Engine.attach(spec)
        try:
            say("phase wait")
            try:
                serve(engine, args.updates)
            except EngineError as exc:  # when the engine saw it; the clean-up and exit come after
                say(f"engine failed at {time.monotonic():.3f}: {exc}")
                raise
        finally:
            engine.close()
    say("done")
    return 0


def serve(engine: Engine, n_updates: int) -> None:
    engine.wait_until_ready(120)
    for i in range(40):
        engine.add_request([(7 * i + j) % VOCAB for j in range(8)], 40, request_id=f"r{i}", preemption="offload")
    say("phase stream")
    steps, updates = 0, 0
    while engine.has_work():
        engine.step_stream()
        steps += 1
        if updates < n_updates and steps % 25 == 0:
            updates += 1
            say("phase update")
            engine.update_weights(f"v{updates}")
            say("phase stream")

if __name__ == "__main__":
    sys.exit(main())

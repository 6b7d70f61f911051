#!/usr/bin/env python
"""What the KV checks cost: a host-tier checksum per block against copying the block, and
the synthetic runner's oracle per decode step against the step's simulated compute.

Host checksums (``spec.host_checksums``): xxh3-128 of one host block, written on SWAP_OUT
and LOAD, checked on SWAP_IN and STORE, against one memcpy of the block (what the CPU swap
op does per block). Oracle: ``SyntheticRunner`` reads one header per context position of
every sampled sequence each step. Prints one JSON line per measurement.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.config import KVLayout  # noqa: E402
from fastkv.engine.runners.synthetic import SyntheticRunner  # noqa: E402
from fastkv.engine.step import SeqWork, StepPlan  # noqa: E402


def best_us(fn, reps: int = 200) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e6


def checksum_vs_copy(block_bytes: int) -> dict:
    src = np.random.default_rng(0).integers(0, 256, block_bytes, np.uint8)
    dst = np.empty_like(src)
    copy = best_us(lambda: np.copyto(dst, src))
    digest = best_us(lambda: xxhash.xxh3_128_digest(src))
    return {"bench": "host_checksum", "block_bytes": block_bytes, "copy_us": round(copy, 2),
            "xxh3_128_us": round(digest, 2), "ratio": round(digest / copy, 2)}


def oracle_per_step(seqs: int, context: int) -> dict:
    """A decode step of ``seqs`` sequences of ``context`` tokens on the demo's layout."""
    lay = KVLayout(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="float32")
    per_seq = -(-(context + 1) // lay.block_size)
    k = [np.zeros(lay.device_shape(seqs * per_seq), lay.numpy_dtype) for _ in range(lay.num_layers)]
    v = [np.zeros_like(a) for a in k]
    runner = SyntheticRunner(lay, 0, 1, k, v, verify="resumed")
    tables = [np.arange(i * per_seq, (i + 1) * per_seq) for i in range(seqs)]
    runner.step(StepPlan(0, [SeqWork(i, np.arange(context) % 1000, 0, tables[i], True) for i in range(seqs)]))
    plan = StepPlan(1, [SeqWork(i, [7], context, tables[i], True) for i in range(seqs)])
    oracle = best_us(lambda: runner._sample(plan.seqs), reps=20)
    step = best_us(lambda: runner.step(plan), reps=20)
    return {"bench": "oracle", "seqs": seqs, "context": context, "oracle_us": round(oracle, 1),
            "step_us_without_simulated_compute": round(step, 1),
            "demo_simulated_compute_us": 300 * seqs}


def main() -> int:
    for block_bytes in (64 * 1024, 2 * 1024 * 1024):  # the demo's block; the reference block
        print(json.dumps(checksum_vs_copy(block_bytes)), flush=True)
    for seqs, context in ((8, 500), (16, 1000), (32, 2000)):
        print(json.dumps(oracle_per_step(seqs, context)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""What the KV checks cost: a host-tier checksum per block against copying the block, and
the synthetic runner's oracle per decode step against the step's simulated compute.

Host checksums (``spec.host_checksums``): the checksum of one host block (xxh3 per page,
``tiers.block_checksum``) as the transfer process computes it (the ops kernel; the block is
in the cache here. SWAP_IN, STORE and LOAD pay it; a CPU SWAP_OUT hashes each page in its copy's pass, see
bench_swap), against one memcpy of the block (what the CPU swap op does per block).
Oracle: ``SyntheticRunner`` reads one header per context position of
every sampled sequence each step. Prints a table, then one JSON line:
``{"bench": "checksum", "us_per_block": {...}, "oracle_us": {...}}``.

    python scripts/bench_checksum.py            # 64 KiB (the demo's) and 2 MiB blocks
    python scripts/bench_checksum.py --smoke    # a few repetitions, for the smoke test
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.config import KVLayout  # noqa: E402
from fastkv.engine.runners.synthetic import SyntheticRunner  # noqa: E402
from fastkv.kernels import ops  # noqa: E402
from fastkv.sched.output import SeqWork, StepPlan  # noqa: E402


def best_us(fn, reps: int = 200) -> float:
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        times.append((time.perf_counter() - t0) / reps)
    return min(times) * 1e6


def checksum_vs_copy(layers: int, page_bytes: int, reps: int) -> tuple[float, float]:
    """(the kernel's checksum of one block, one copy of it), best of 5, in microseconds."""
    host = np.random.default_rng(0).integers(0, 256, (1, layers, 2, page_bytes), np.uint8)
    dst = np.empty_like(host)
    ids = np.zeros(1, np.int32)
    return best_us(lambda: ops.block_checksums(host, ids), reps), best_us(lambda: np.copyto(dst, host), reps)


def oracle_per_step(seqs: int, context: int, reps: int) -> tuple[float, float]:
    """A decode step of ``seqs`` sequences of ``context`` tokens on the demo's layout."""
    lay = KVLayout(num_layers=4, kv_heads=2, block_size=16, head_dim=64, dtype="float32")
    per_seq = -(-(context + 1) // lay.block_size)
    k = [np.zeros(lay.device_shape(seqs * per_seq), lay.numpy_dtype) for _ in range(lay.num_layers)]
    v = [np.zeros_like(a) for a in k]
    runner = SyntheticRunner(lay, 0, 1, k, v, verify="resumed")
    tables = [np.arange(i * per_seq, (i + 1) * per_seq) for i in range(seqs)]
    runner.step(StepPlan(0, [SeqWork(i, np.arange(context) % 1000, 0, tables[i], True) for i in range(seqs)]))
    plan = StepPlan(1, [SeqWork(i, [7], context, tables[i], True) for i in range(seqs)])
    return best_us(lambda: runner._sample(plan.seqs), reps), 300.0 * seqs  # the demo charges 300 us/token


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a few repetitions: checks the script, not the numbers")
    args = p.parse_args()
    # (layers, page bytes): the demo's block; the reference block
    blocks = {"64k": (4, 8 << 10), "2m": (8, 128 << 10)}
    ops.load()
    steps = ((8, 500), (16, 1000), (32, 2000))
    reps = 2 if args.smoke else 200
    us_per_block: dict[str, float] = {}
    print(f"{'block':>6} {'checksum us':>12} {'copy us':>9} {'ratio':>6}")
    for name, (layers, page) in blocks.items():
        digest, copy = checksum_vs_copy(layers, page, reps)
        us_per_block |= {f"checksum_{name}": round(digest, 2), f"copy_{name}": round(copy, 2)}
        print(f"{name:>6} {digest:12.2f} {copy:9.2f} {digest / copy:6.2f}")
    oracle_us: dict[str, float] = {}
    print(f"\n{'seqs x context':>15} {'oracle us':>10} {'simulated compute us':>21} {'share':>6}")
    for seqs, context in steps:
        oracle, compute = oracle_per_step(seqs, context, 1 if args.smoke else 20)
        oracle_us[f"{seqs}x{context}"] = round(oracle, 1)
        print(f"{f'{seqs} x {context}':>15} {oracle:10.1f} {compute:21.0f} {oracle / compute:6.1%}")
    print(json.dumps({"bench": "checksum", "us_per_block": us_per_block, "oracle_us": oracle_us}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

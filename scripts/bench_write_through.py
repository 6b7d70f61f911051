#!/usr/bin/env python
"""The cache manager's bookkeeping per block fill as contexts grow, by write policy.

A decoding request fills a block every ``block_size`` tokens: the manager appends a block,
marks it computed and, under write-through, copies it to the host and settles the copy when it
lands (here at once, with no transfer process: manager time only). Write-through keeps the
chain's host order leaves first. A running request holds its chain's host copies
(``tiering.hold_chain``), so a fill costs the same at any context length, and the walk over
the chain happens once, when the request lets go (``tiering.release_chain``): the second
figure, microseconds per free of a request of that context. (Before, every write-through held
and refreshed its whole chain: 55, 200 and 726 us per fill at 64, 512 and 2048 blocks.) This
measures both, side by side with write-back and a device tier alone, over the same growth.

``--requests`` requests of each context length (in blocks of ``--block-size`` tokens) grow by
``--fills`` blocks each, in turn; the figure is the best of ``--repeat`` runs. The last line is

    {"bench": "write_through", "block_size": 16, "us_per_block_fill": {"write_through": {CONTEXT: us, ...},
     "write_back": {...}, "device_only": {...}}, "us_per_free": {...}}

with CONTEXT the context length in blocks, as a string.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.cache.manager import CacheConfig, CacheManager  # noqa: E402
from fastkv.cache.write_policy import WritePolicy  # noqa: E402

POLICIES = {"write_through": WritePolicy.WRITE_THROUGH, "write_back": WritePolicy.WRITE_BACK, "device_only": None}


def us_per_block_fill(policy: WritePolicy | None, context: int, requests: int, fills: int,
                      bs: int) -> tuple[float, float]:
    """Manager microseconds per block fill of ``requests`` requests of ``context`` blocks, and
    per free of one of them afterwards."""
    blocks = requests * (context + fills + 1)
    m = CacheManager(CacheConfig(num_device_blocks=blocks, num_host_blocks=2 * blocks if policy else 0,
                                 block_size=bs, policy=policy or WritePolicy.WRITE_THROUGH))
    tokens: dict[int, list[int]] = {}

    def settle(plans) -> None:
        for p in plans:
            m.complete(p, True)

    for r in range(requests):
        tokens[r] = [r << 24 | i + 1 for i in range(context * bs)]  # no shared prefixes (contexts < 2**24 tokens)
        m.allocate(r, tokens[r])
        settle(m.mark_computed(r, len(tokens[r])))
    t0 = time.perf_counter()
    for _ in range(fills):
        for r in range(requests):
            toks = tokens[r]
            new = [r << 24 | len(toks) + i + 1 for i in range(bs)]
            growth = m.append_slots(r, new)
            assert growth is not None, "the device tier was sized for every fill"
            settle(growth.plans)
            toks += new
            settle(m.mark_computed(r, len(toks)))
    seconds = time.perf_counter() - t0
    m.check_integrity()
    t0 = time.perf_counter()
    for r in range(requests):
        m.free(r)
    freed = time.perf_counter() - t0
    m.check_integrity()
    return seconds / (fills * requests) * 1e6, freed / requests * 1e6


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="64,512,2048", help="context lengths in blocks (default 64,512,2048)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--fills", type=int, default=32)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--smoke", action="store_true", help="tiny sizes (tests: numbers mean nothing)")
    args = p.parse_args()
    try:
        contexts = [int(c) for c in args.contexts.split(",")]
    except ValueError:
        raise SystemExit(f"bench_write_through: --contexts must be integers separated by commas, got "
                         f"{args.contexts!r}") from None
    if args.smoke:
        contexts, args.requests, args.fills, args.repeat = [4, 16], 2, 4, 1
    if min(contexts) < 1 or min(args.block_size, args.requests, args.fills, args.repeat) < 1:
        raise SystemExit("bench_write_through: contexts, --block-size, --requests, --fills and --repeat must be >= 1")
    table: dict[str, dict[str, float]] = {name: {} for name in POLICIES}
    frees: dict[str, dict[str, float]] = {name: {} for name in POLICIES}
    print(f"manager us per block fill (and per free of a request afterwards): {args.requests} requests x "
          f"{args.fills} fills, blocks of {args.block_size} tokens, best of {args.repeat}")
    print("| context (blocks) | " + " | ".join(POLICIES) + " | write_through / write_back | "
          + " | ".join(f"free, {name}" for name in POLICIES) + " |")
    print("|---" * (2 * len(POLICIES) + 2) + "|")
    for c in contexts:
        for name, policy in POLICIES.items():
            runs = [us_per_block_fill(policy, c, args.requests, args.fills, args.block_size)
                    for _ in range(args.repeat)]
            table[name][str(c)] = round(min(fill for fill, _ in runs), 1)
            frees[name][str(c)] = round(min(free for _, free in runs), 1)
        row = [table[name][str(c)] for name in POLICIES]
        print(f"| {c} | " + " | ".join(f"{v:.1f}" for v in row) +
              f" | {table['write_through'][str(c)] / max(table['write_back'][str(c)], 1e-9):.2f} | " +
              " | ".join(f"{frees[name][str(c)]:.1f}" for name in POLICIES) + " |")
    print(json.dumps({"bench": "write_through", "block_size": args.block_size, "us_per_block_fill": table,
                      "us_per_free": frees}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

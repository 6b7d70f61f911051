#!/usr/bin/env python
"""How long LMDB writes stall another thread of the writing process, against another process.

Why: the transfer process runs STOREs on a storage thread beside its swap lane (the loop
thread), on the premise that storage I/O releases the GIL (``fastkv.transfer.lanes``). bench_swap's
``lane_p99_ratio`` still sees SWAP_INs of ~1-3 ms beside a STORE to LMDB. This measures the
premise alone: a clock-reading loop (``ticker``: Python, garbage collector off, into a touched
array, under the lanes' 0.2 ms switch interval) records every gap in its progress while
``LMDBStore.put`` writes ``--mib`` of 2 MiB blocks (fastkv's own transactions), with the ticker

- ``idle``: alone, no writes (this machine's own stalls of a running thread);
- ``thread``: on a thread of the writing process (where the swap lane runs today);
- ``process``: in another process (where a storage process would leave it).

Rounds take turns (``--rounds``, default 5). Prints per setting the longest gap and the gaps over
1 ms per round, then one JSON line:
``{"bench": "lmdb_stall", "max_gap_ms": {"idle", "thread", "process"}, "gaps_over_1ms": {...},
"write_gbps": ...}``.

    python scripts/bench_lmdb_stall.py            # 64 MiB per write, 5 rounds
    python scripts/bench_lmdb_stall.py --smoke    # 8 MiB, 1 round (tests: numbers mean nothing)
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import sys
import tempfile
import threading
import time
from multiprocessing import shared_memory
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.storage.base import namespace_fingerprint  # noqa: E402
from fastkv.storage.lmdb_store import LMDBStore  # noqa: E402
from fastkv.transfer.lanes import GIL_SWITCH_S  # noqa: E402

BLOCK = 2 << 20
SLOTS = 8_000_000  # clock samples a ticker can hold (about 1 s of them)


def ticker(buf: np.ndarray, seconds: float) -> None:
    """Writes the clock into ``buf`` until ``seconds`` pass; the sample count goes in the last slot."""
    clock, end, i, last = time.perf_counter, time.perf_counter() + seconds, 0, len(buf) - 1
    while i < last:
        t = clock()
        buf[i] = t
        i += 1
        if t > end:
            break
    buf[last] = i


def ticker_process(shm_name: str, seconds: float, ready) -> None:
    gc.disable()
    shm = shared_memory.SharedMemory(shm_name)
    try:
        buf = np.ndarray((SLOTS,), np.float64, shm.buf)
        ready.set()
        ticker(buf, seconds)
        del buf
    finally:
        shm.close()


def gaps_ms(buf: np.ndarray, start: float, end: float) -> np.ndarray:
    """The gaps (ms) between the ticker's samples within [start, end]."""
    t = buf[:int(buf[-1])]
    if not t.size or t[0] > start or t[-1] < end:
        raise RuntimeError("the ticker did not cover the writes (its buffer filled, or it started late)")
    t = t[(t >= start) & (t <= end)]
    return np.diff(t) * 1e3


def one_round(setting: str, nbytes: int, buf: np.ndarray, shm_name: str) -> tuple[np.ndarray, float]:
    """The ticker's gaps while ``setting`` runs, and the write's GB/s (0 for idle)."""
    n = nbytes // BLOCK
    host = np.ones((n, BLOCK), np.uint8)  # touched: the writes fault nothing in
    keys = [i.to_bytes(32, "little") for i in range(n)]
    buf[-1] = 0
    seconds = 0.4 + nbytes / 0.2e9  # covers the write with room (LMDB here: ~0.3-3 GB/s)
    with tempfile.TemporaryDirectory(prefix="fkvstall") as tmp:
        store = LMDBStore(tmp, namespace_fingerprint("bench_lmdb_stall"), max_bytes=4 * nbytes)
        try:
            # The store's first put allocates its 2 MiB scratch value under the GIL (a ~1 ms stall of
            # the thread beside it); a transfer process pays that once in its life, not per STORE.
            assert store.put([bytes(32)], host, [0]) == [True]
            if setting == "process":
                ready = mp.get_context("spawn").Event()
                side = mp.get_context("spawn").Process(target=ticker_process, args=(shm_name, seconds, ready))
                side.start()
                ready.wait(60)
            else:
                side = threading.Thread(target=ticker, args=(buf, seconds))
                side.start()
            time.sleep(0.1)  # the ticker runs before the writes start
            t0 = time.perf_counter()
            if setting == "idle":
                time.sleep(0.05)
            else:
                for lo in range(0, n, 2):  # as a STORE's parts hand them to put
                    assert all(store.put(keys[lo:lo + 2], host, range(lo, min(lo + 2, n))))
            t1 = time.perf_counter()
            side.join()
        finally:
            store.close()
    return gaps_ms(buf, t0, t1), (0.0 if setting == "idle" else nbytes / (t1 - t0) / 1e9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="MiB written per round (2 MiB blocks)")
    p.add_argument("--rounds", type=int, default=0, help="rounds of each setting, in turns (default 5, --smoke 1)")
    p.add_argument("--smoke", action="store_true", help="8 MiB, 1 round (tests: numbers mean nothing)")
    args = p.parse_args()
    if args.mib < 2 or args.rounds < 0:
        p.error("--mib must be at least 2 and --rounds at least 0")
    nbytes = (8 if args.smoke else args.mib) << 20
    rounds = args.rounds or (1 if args.smoke else 5)
    gc.disable()  # a collection would stall the ticker thread itself
    sys.setswitchinterval(GIL_SWITCH_S)  # as the transfer process runs once its storage lane starts
    settings = ("idle", "thread", "process")
    worst = dict.fromkeys(settings, 0.0)
    over: dict[str, list[int]] = {s: [] for s in settings}
    gbps: list[float] = []
    shm = shared_memory.SharedMemory(create=True, size=SLOTS * 8)
    try:
        buf = np.ndarray((SLOTS,), np.float64, shm.buf)
        buf[:] = 0.0
        for r in range(rounds):
            for s in settings:
                g, rate = one_round(s, nbytes, buf, shm.name)
                worst[s] = max(worst[s], float(g.max()) if g.size else 0.0)
                over[s].append(int(np.count_nonzero(g > 1.0)))
                if rate:
                    gbps.append(rate)
            print(f"round {r + 1} of {rounds}: longest gap ms " + ", ".join(f"{s} {worst[s]:.2f}" for s in settings),
                  flush=True)
        del buf
    finally:
        shm.close()
        shm.unlink()
    print(f"\n{nbytes >> 20} MiB of 2 MiB blocks through LMDBStore.put per round, {rounds} rounds; "
          f"a Python clock loop beside it:\n")
    print("| ticker | longest gap ms | gaps over 1 ms per round |")
    print("|---|---|---|")
    for s in settings:
        print(f"| {s} | {worst[s]:.2f} | {np.mean(over[s]):.1f} |")
    print(f"\nLMDB writes ran at {np.median(gbps):.2f} GB/s (median of rounds)")
    print(json.dumps({"bench": "lmdb_stall", "max_gap_ms": {s: round(worst[s], 2) for s in settings},
                      "gaps_over_1ms": {s: round(float(np.mean(over[s])), 1) for s in settings},
                      "write_gbps": round(float(np.median(gbps)), 2)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

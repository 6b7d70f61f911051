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

from fastkv.cli import at_least  # noqa: E402
from fastkv.storage.base import namespace_fingerprint  # noqa: E402
from fastkv.storage.lmdb_store import LMDBStore  # noqa: E402
from fastkv.transfer.lanes import GIL_SWITCH_S  # noqa: E402

BLOCK = 2 << 20
SLOTS = 16_000_000  # clock samples a ticker can hold (1-2 s of them: --mib is bounded to fit)
COUNT, STOP = SLOTS - 1, SLOTS - 2  # the buffer's last slots: samples taken, and the stop flag


def ticker(buf: np.ndarray) -> None:
    """Writes the clock into ``buf`` until the stop flag is set; then the sample count."""
    clock, i = time.perf_counter, 0
    while i < STOP and not buf[STOP]:
        buf[i] = clock()
        i += 1
    buf[COUNT] = i


def ticker_process(shm_name: str, ready) -> None:
    gc.disable()
    shm = shared_memory.SharedMemory(shm_name)
    try:
        buf = np.ndarray((SLOTS,), np.float64, shm.buf)
        ready.set()
        ticker(buf)
        del buf
    finally:
        shm.close()


def gaps_ms(buf: np.ndarray, start: float, end: float) -> np.ndarray:
    """The gaps (ms) between the ticker's samples over [start, end], those across its ends included."""
    t = buf[:int(buf[COUNT])]
    if not t.size or t[0] > start or t[-1] < end:
        raise RuntimeError("the clock loop did not cover the writes (its buffer filled: try a smaller --mib)")
    first, last = np.searchsorted(t, start, side="right") - 1, np.searchsorted(t, end, side="left")
    return np.diff(t[first:last + 1]) * 1e3


def one_round(setting: str, nbytes: int, buf: np.ndarray, shm_name: str) -> tuple[np.ndarray, float]:
    """The ticker's gaps while ``setting`` runs, and the write's GB/s (0 for idle)."""
    n = nbytes // BLOCK
    host = np.ones((n, BLOCK), np.uint8)  # touched: the writes fault nothing in
    keys = [i.to_bytes(32, "little") for i in range(n)]
    buf[COUNT] = buf[STOP] = 0
    with tempfile.TemporaryDirectory(prefix="fkvstall") as tmp:
        store = LMDBStore(tmp, namespace_fingerprint("bench_lmdb_stall"), max_bytes=4 * nbytes)
        side = None
        try:
            # The store's first put allocates its 2 MiB scratch value under the GIL (a ~1 ms stall of
            # the thread beside it); a transfer process pays that once in its life, not per STORE.
            assert store.put([b"\xff" * 32], host, [0]) == [True]  # a key the round does not write
            if setting == "process":
                ready = mp.get_context("spawn").Event()
                side = mp.get_context("spawn").Process(target=ticker_process, args=(shm_name, ready))
                side.start()
                if not ready.wait(60):
                    raise RuntimeError("the clock-loop process did not start within 60 s")
            else:
                side = threading.Thread(target=ticker, args=(buf,))
                side.start()
            time.sleep(0.1)  # the ticker runs before the writes start
            t0 = time.perf_counter()
            if setting == "idle":
                time.sleep(0.05)
            else:
                for lo in range(0, n, 2):  # as a STORE's parts hand them to put
                    assert all(store.put(keys[lo:lo + 2], host, range(lo, min(lo + 2, n))))
            t1 = time.perf_counter()
            time.sleep(0.01)  # the clock loop samples past t1
        finally:
            buf[STOP] = 1
            if side is not None:
                side.join()
            store.close()
    return gaps_ms(buf, t0, t1), (0.0 if setting == "idle" else nbytes / (t1 - t0) / 1e9)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=64, help="MiB written per round (2 MiB blocks)")
    p.add_argument("--rounds", type=at_least(0), default=0,
                   help="rounds of each setting, in turns (default 5, --smoke 1)")
    p.add_argument("--smoke", action="store_true", help="8 MiB, 1 round (tests: numbers mean nothing)")
    args = p.parse_args()
    if not 2 <= args.mib <= 256 or args.rounds < 0:
        p.error(f"--mib must be 2 to 256 (the clock loop's buffer covers about a second), got {args.mib}; "
                f"--rounds at least 0, got {args.rounds}")
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
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the finally blocks have removed the buffer and the stores
        sys.exit("bench_lmdb_stall: interrupted")

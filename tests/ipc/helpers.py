"""Shared pieces of the IPC tests: a namespace fixture and multi-process helpers."""
from __future__ import annotations

import multiprocessing as mp
from pathlib import Path

CTX = mp.get_context("fork")  # children attach by name; fork keeps start-up fast
SHM = Path("/dev/shm")


def run_objects(run_id: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if p.name.startswith((f"fkv.{run_id}.", f"sem.fkv.{run_id}.")))


def start(target, *args):
    p = CTX.Process(target=target, args=args, daemon=True)
    p.start()
    return p


def reap(*procs, timeout: float = 10.0) -> list[int]:
    codes = []
    for p in procs:
        p.join(timeout)
        if p.is_alive():
            p.kill()
            p.join()
            raise AssertionError(f"child {p.pid} did not finish within {timeout} s")
        codes.append(p.exitcode)
    return codes

"""The compiled helpers of the IPC layer: ``A`` is ``fastkv.native._atomics`` (ops/shm_atomics.c:
atomics, fences, the ring fast path) and ``C`` is ``fastkv.native._codec`` (ops/ipc_codec.c: the
message codec's fast path). Short names: they are used on every hot-path call."""
from __future__ import annotations

from fastkv.native.compiled import load

A = load("_atomics")
C = load("_codec")

__all__ = ["A", "C"]

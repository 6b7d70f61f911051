"""Block keys computed from docs/DESIGN.md's byte-level key spec (section Keys) with the blake3
package alone: none of fastkv's key code, so that a test comparing fastkv's keys (the cache's,
the router's) with these compares two implementations, not one with itself."""
from __future__ import annotations

import struct

from blake3 import blake3


def field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<I", len(value)) + value


def namespace(model_id: str, weights_version: str, layout_description: str, kv_dtype: str, block_size: int,
              tp_size: int) -> bytes:
    data = b"".join(field(tag, str(v).encode()) for tag, v in (
        (b"M", model_id), (b"W", weights_version), (b"L", layout_description), (b"D", kv_dtype),
        (b"B", block_size), (b"T", tp_size)))
    return blake3(data, derive_key_context="fastkv 2025 namespace v1").digest()


def root(fingerprint: bytes, lora_id=None) -> bytes:
    data = fingerprint + (field(b"lora", str(lora_id).encode()) if lora_id is not None else b"")
    return blake3(data, derive_key_context="fastkv 2025 root key v1").digest()


def chain_from(key: bytes, tokens, block_size: int, mm=()) -> list[bytes]:
    """The keys of the full blocks of ``tokens`` chained from ``key`` (the root, or the key of
    the block before them); ``mm``: ``(start, end, item hash)`` multimodal items."""
    keys = []
    for i in range(len(tokens) // block_size):
        lo, hi = i * block_size, (i + 1) * block_size
        block = struct.pack(f"<{block_size}i", *(int(t) for t in tokens[lo:hi]))
        extra = b"".join(field(b"mm", struct.pack("<qq", s, e) + h) for s, e, h in mm if s < hi and e > lo)
        key = blake3(key + block + extra).digest()
        keys.append(key)
    return keys


def chain(tokens, fingerprint: bytes, block_size: int, lora_id=None, mm=()) -> list[bytes]:
    """The keys of the full blocks of ``tokens`` under the namespace ``fingerprint``."""
    return chain_from(root(fingerprint, lora_id), tokens, block_size, mm)

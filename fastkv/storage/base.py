"""The storage-backend interface and the value format every backend stores.

A backend instance serves one tensor-parallel rank. The cache core hands it 32-byte block
keys (blake3 digests that chain the namespace but not the rank); the backend stores rank
``r``'s shard of block ``key`` under a shard key formed from ``key`` and ``r``. All ranks'
shards of one key are a *key family*.

Value format (little endian), 128-byte header then the payload (one host block)::

    offset size  field
    0      4     magic b"FKVB"
    4      2     format version (1)
    6      2     rank
    8      2     tp_size
    10     6     reserved, zero
    16     8     payload length in bytes
    24     32    namespace fingerprint
    56     32    block key (the family key)
    88     24    reserved, zero
    112    16    checksum: xxh3-128 over header bytes [0, 112) followed by the payload

The checksum covers the header too, so a flipped bit anywhere in a value is caught; the
explicit fields make a mismatch name its cause. A value that fails any check is a miss:
the backend deletes it and counts it as ``corrupt``. The host block of a miss holds no verified
bytes: most backends leave it untouched; one that ``lands_in_place`` (Mooncake: the payload is
read straight into it, with no staging copy) may leave a rejected value there. Callers load only
into blocks nothing else reads, and key them only once the load succeeded: the cache LOADs into
fresh host blocks and keys them on success, the executor unseals a block whose load failed.

Every backend operation is a batch and never raises for a server failure: a failed
``get`` is a miss, a failed ``put`` returns False, and ``errors`` counts them. Bad input
(wrong key type, block id out of range, a host array of the wrong shape) raises.
"""
from __future__ import annotations

import struct
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, fields
from enum import IntEnum

import blake3
import numpy as np
import xxhash

MAGIC = b"FKVB"
FORMAT_VERSION = 1
KEY_BYTES = 32
HEADER_BYTES = 128
_PREFIX = struct.Struct("<4sHHH6xQ32s32s24x")  # header bytes [0, 112): everything but the checksum
_CHECKSUM_AT = _PREFIX.size
assert _CHECKSUM_AT + 16 == HEADER_BYTES, "header layout drifted from its spec"
MAX_RANKS = 1 << 16


def namespace_fingerprint(*parts: str | bytes) -> bytes:
    """A 32-byte fingerprint of everything that changes a block's bytes (model, weights
    version, dtype, layout, ...). Backends compare it on every read."""
    h = blake3.blake3()
    for part in parts:
        data = part.encode() if isinstance(part, str) else bytes(part)
        h.update(len(data).to_bytes(8, "little"))  # length-prefixed: ("ab","c") != ("a","bc")
        h.update(data)
    return h.digest()


class Verdict(IntEnum):
    """Why a stored value was or was not accepted (OK first, then the first failed check)."""

    OK = 0
    SHORT = 1  # shorter than a header
    MAGIC = 2
    VERSION = 3
    NAMESPACE = 4  # written by another model / weights version / layout
    KEY = 5  # a value stored under the wrong key
    RANK = 6  # another rank's shard
    LENGTH = 7  # payload length differs from the header or from the host block
    CHECKSUM = 8


@dataclass(frozen=True, slots=True)
class ValueCodec:
    """Encodes and verifies values for one (namespace, rank, tp_size)."""

    namespace: bytes
    rank: int
    tp_size: int

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, bytes) or len(self.namespace) != 32:
            raise ValueError(f"namespace fingerprint must be 32 bytes, got {self.namespace!r:.80}")
        if not isinstance(self.tp_size, int) or not 0 < self.tp_size <= MAX_RANKS:
            raise ValueError(f"tp_size must be an int in [1, {MAX_RANKS}], got {self.tp_size!r}")
        if not isinstance(self.rank, int) or not 0 <= self.rank < self.tp_size:
            raise ValueError(f"rank must be an int in [0, tp_size={self.tp_size}), got {self.rank!r}")

    def header(self, key: bytes, payload: memoryview) -> bytes:
        """The 128-byte header of ``payload`` stored under ``key``."""
        prefix = _PREFIX.pack(MAGIC, FORMAT_VERSION, self.rank, self.tp_size, len(payload), self.namespace, key)
        h = xxhash.xxh3_128(prefix)
        h.update(payload)
        return prefix + h.digest()

    def verify(self, key: bytes, value, payload_bytes: int) -> Verdict:
        """Checks a stored value (any buffer) against ``key`` and the expected payload size."""
        mv = memoryview(value)
        if mv.nbytes < HEADER_BYTES:
            return Verdict.SHORT
        verdict = self._header_verdict(key, mv, payload_bytes)
        if verdict is not Verdict.OK:
            return verdict
        if mv.nbytes != HEADER_BYTES + payload_bytes:
            return Verdict.LENGTH
        return self._checksum_verdict(mv[:HEADER_BYTES], mv[HEADER_BYTES:])

    def verify_split(self, key: bytes, header, payload, nbytes: int, payload_bytes: int) -> Verdict:
        """``verify`` of a value of ``nbytes`` that landed in two buffers: its header and its
        payload (a host block, for a backend that ``lands_in_place``)."""
        hv, pv = memoryview(header), memoryview(payload)
        if nbytes != HEADER_BYTES + payload_bytes or hv.nbytes != HEADER_BYTES or pv.nbytes != payload_bytes:
            return Verdict.SHORT if nbytes < HEADER_BYTES else Verdict.LENGTH
        verdict = self._header_verdict(key, hv, payload_bytes)
        return verdict if verdict is not Verdict.OK else self._checksum_verdict(hv, pv)

    def _header_verdict(self, key: bytes, hv: memoryview, payload_bytes: int) -> Verdict:
        magic, version, rank, tp_size, length, namespace, vkey = _PREFIX.unpack_from(hv)
        if magic != MAGIC:
            return Verdict.MAGIC
        if version != FORMAT_VERSION:
            return Verdict.VERSION
        if namespace != self.namespace or tp_size != self.tp_size:
            return Verdict.NAMESPACE
        if vkey != key:
            return Verdict.KEY
        if rank != self.rank:
            return Verdict.RANK
        if length != payload_bytes:
            return Verdict.LENGTH
        return Verdict.OK

    @staticmethod
    def _checksum_verdict(hv: memoryview, pv: memoryview) -> Verdict:
        h = xxhash.xxh3_128(hv[:_CHECKSUM_AT])
        h.update(pv)
        return Verdict.OK if h.digest() == hv[_CHECKSUM_AT:HEADER_BYTES] else Verdict.CHECKSUM


@dataclass(slots=True)
class StoreStats:
    """Counters of one backend instance (one rank, one process)."""

    hits: int = 0  # get: loaded and verified
    misses: int = 0  # get: absent, corrupt or failed
    corrupt: int = 0  # values that failed verification (deleted)
    errors: int = 0  # operations (batches) that failed on the server or its connection
    skipped: int = 0  # operations answered without the server, in a backoff after failures
    stored: int = 0  # put: blocks written
    store_failed: int = 0  # put: blocks not written
    bytes_read: int = 0  # payload bytes copied into host blocks
    bytes_written: int = 0  # payload bytes stored

    def snapshot(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}

    def count_get(self, results: list[bool], payload_bytes: int) -> list[bool]:
        """Account one get batch (``results`` per key); returns ``results``."""
        hits = sum(results)
        self.hits += hits
        self.misses += len(results) - hits
        self.bytes_read += hits * payload_bytes
        return results

    def count_put(self, results: list[bool], payload_bytes: int) -> list[bool]:
        """Account one put batch (``results`` per key); returns ``results``."""
        stored = sum(results)
        self.stored += stored
        self.store_failed += len(results) - stored
        self.bytes_written += stored * payload_bytes
        return results


def host_blocks(host: np.ndarray, writable: bool) -> np.ndarray:
    """The host tier as uint8 ``[num_blocks, block_bytes]`` without copying."""
    if not isinstance(host, np.ndarray):
        raise TypeError(f"host must be a numpy array, got {type(host).__name__}")
    if host.ndim < 2 or host.shape[0] == 0 or not host.flags.c_contiguous:
        raise ValueError(f"host must be a C-contiguous block-major array, got shape {host.shape}")
    if writable and not host.flags.writeable:
        raise ValueError("host array is read-only; get() writes into it")
    return host.reshape(host.shape[0], -1).view(np.uint8)


def check_batch(keys: Sequence[bytes], block_ids, num_blocks: int) -> list[int]:
    """Validates a batch; returns the block ids as Python ints."""
    check_keys(keys)
    ids = [int(b) for b in np.asarray(block_ids, dtype=np.int64).reshape(-1)]
    if len(ids) != len(keys):
        raise ValueError(f"need one block id per key: {len(keys)} keys, {len(ids)} block ids")
    for b in ids:
        if not 0 <= b < num_blocks:
            raise ValueError(f"block id {b} out of range [0, {num_blocks})")
    return ids


def check_keys(keys: Sequence[bytes]) -> None:
    if isinstance(keys, bytes | str):
        raise TypeError("keys must be a sequence of 32-byte keys, not a single key")
    for k in keys:
        if not isinstance(k, bytes) or len(k) != KEY_BYTES:
            raise ValueError(f"a block key must be {KEY_BYTES} bytes, got {k!r:.80}")


class StorageBackend(ABC):
    """One rank's view of a storage tier. Not thread-safe: one caller thread per instance."""

    codec: ValueCodec
    stats: StoreStats
    # False where a put of a key already stored keeps the stored value (Mooncake's objects are
    # immutable). Either is correct here: a block key addresses its content, so both carry the
    # same bytes.
    overwrites: bool = True
    # True where ``get`` reads a payload straight into its host block and checks it there, so a
    # block whose result is False may hold a rejected value's bytes (module docstring)
    lands_in_place: bool = False

    def __init__(self, namespace: bytes, rank: int, tp_size: int) -> None:
        self.codec = ValueCodec(namespace, rank, tp_size)
        self.stats = StoreStats()

    @property
    def rank(self) -> int:
        return self.codec.rank

    def shard_key(self, key: bytes) -> bytes:
        """This rank's storage key for block ``key`` (family key, then the rank)."""
        return key + self.codec.rank.to_bytes(2, "big")

    @abstractmethod
    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether this rank's shard of each key is stored (unverified: get() decides)."""

    @abstractmethod
    def put(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        """Stores host block ``block_ids[i]`` under ``keys[i]``; True where written."""

    @abstractmethod
    def get(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        """Loads ``keys[i]`` into host block ``block_ids[i]``; True where loaded and verified.
        A block whose result is False holds no verified bytes (untouched unless ``lands_in_place``)."""

    @abstractmethod
    def delete(self, keys: Sequence[bytes]) -> None:
        """Removes this rank's shard of each key (absent keys are fine)."""

    def check(self) -> None:
        """Raises (the backend's own error) if the backend cannot serve now: one round trip,
        unlike the batch operations, which count a failure and go on. Backends whose errors
        say more override it."""
        errors = self.stats.errors
        self.exists([bytes(KEY_BYTES)])
        if self.stats.errors != errors:
            raise ConnectionError("a lookup failed (the backend logged why)")

    @abstractmethod
    def close(self) -> None:
        """Releases connections / the environment. Idempotent."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

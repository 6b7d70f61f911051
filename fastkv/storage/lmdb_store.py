"""Embedded storage tier: one LMDB environment per engine directory, shared by the
transfer processes of all ranks, bounded in bytes with LRU eviction of whole key families.

Sub-databases of the environment::

    blocks    family key (32) + rank (2, big endian)  -> value (header + payload, see base.py)
    families  family key (32)                         -> tick (u64) + bytes of all its shards (u64)
    lru       tick (8, big endian) + family key (32)  -> b""      (oldest first)
    meta      b"used"                                 -> total bytes of all values (u64)

A shard key starts with its family key, so one family's shards are adjacent in ``blocks``
and evicting a family is one range scan. ``used`` only counts value bytes; LMDB's page
overhead lives in the slack between ``max_bytes`` and ``map_size``.

Concurrency: every rank's transfer process opens the same directory. LMDB admits one
write transaction at a time across processes (a robust mutex in lock.mdb, so a writer
killed mid-transaction does not wedge the others) and any number of MVCC readers, so a
reader never sees a half-written value. Eviction, accounting and LRU records change only
inside write transactions, hence stay consistent. Reads do not take the write lock: the
access ticks of hits are remembered in this process and applied at its next write
transaction (put, delete, or ``flush()``), which is the only point where they matter.
Ticks are wall-clock nanoseconds (comparable across the processes of one machine), taken
under the write lock for writes.

Durability: opened with sync=False, metasync=False: no fsync per block. A machine crash
may lose the last transactions; a value that comes back torn fails its checksum and is a
miss. LMDB forbids opening one environment twice in one process, so environments are
shared per (process, directory) with a reference count.
"""
from __future__ import annotations

import logging
import os
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

import lmdb
import numpy as np

from fastkv.storage.base import (
    HEADER_BYTES,
    KEY_BYTES,
    StorageBackend,
    Verdict,
    check_batch,
    check_keys,
    host_blocks,
)

log = logging.getLogger(__name__)

_FAMILY = struct.Struct("<QQ")  # tick, bytes
_USED = b"used"
_TOUCH_FLUSH = 4096  # pending access ticks that force a write transaction of their own
# Bytes written per write transaction (at least one value). With block-sized values, a
# transaction of one or two values commits several times faster than one of many (the
# commit's writev copies dirty pages that are no longer in the CPU cache). Short
# transactions also let the other ranks' processes take the write lock in between.
_TXN_BYTES = 4 << 20


@dataclass(slots=True)
class _Env:
    env: lmdb.Environment
    blocks: object
    families: object
    lru: object
    meta: object
    refs: int = 0


_ENVS: dict[tuple[int, str], _Env] = {}
_last_tick = 0


def _acquire_env(path: str, map_size: int) -> _Env:
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"lmdb store path {path!r} is not a directory")
    os.makedirs(path, mode=0o700, exist_ok=True)
    ident = (os.getpid(), os.path.realpath(path))  # an env inherited over fork must not be reused
    shared = _ENVS.get(ident)
    if shared is None:
        env = lmdb.open(
            path, map_size=map_size, subdir=True, max_dbs=4, sync=False, metasync=False, lock=True,
            mode=0o600,
        )
        env.reader_check()  # clear reader slots of processes that died holding a snapshot
        shared = _Env(
            env, env.open_db(b"blocks"), env.open_db(b"families"), env.open_db(b"lru"), env.open_db(b"meta")
        )
        _ENVS[ident] = shared
    shared.refs += 1
    return shared


def _release_env(path: str) -> None:
    ident = (os.getpid(), os.path.realpath(path))
    shared = _ENVS[ident]
    shared.refs -= 1
    if shared.refs == 0:
        del _ENVS[ident]
        shared.env.close()


class LMDBStore(StorageBackend):
    """One rank's view of the LMDB store in ``path`` (see the module docstring)."""

    def __init__(
        self,
        path: str,
        namespace: bytes,
        rank: int = 0,
        tp_size: int = 1,
        *,
        max_bytes: int = 16 << 30,
        map_size: int | None = None,
    ) -> None:
        super().__init__(namespace, rank, tp_size)
        if not isinstance(max_bytes, int) or max_bytes <= 0:
            raise ValueError(f"max_bytes must be a positive int, got {max_bytes!r}")
        # Room for B-tree pages and for freed pages LMDB cannot reuse while a reader holds them.
        map_size = map_size if map_size is not None else 2 * max_bytes + (64 << 20)
        if map_size <= max_bytes:
            raise ValueError(f"map_size ({map_size}) must exceed max_bytes ({max_bytes})")
        self.path = path
        self.max_bytes = max_bytes
        self._shared: _Env | None = _acquire_env(path, map_size)
        self._touches: dict[bytes, int] = {}
        self._scratch = bytearray()

    # --- the interface -------------------------------------------------------------------

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        sh = self._env()
        try:
            with sh.env.begin(db=sh.blocks, buffers=True) as txn:
                return [txn.get(self.shard_key(k)) is not None for k in keys]
        except lmdb.Error as e:
            self._failed("exists", e)
            return [False] * len(keys)

    def put(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=False)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        results = [False] * len(keys)
        value_bytes = HEADER_BYTES + blocks.shape[1]
        if not keys or value_bytes > self.max_bytes:
            self.stats.store_failed += len(keys)
            return results
        # Checksums outside the write transaction: the lock is held only for copying.
        payloads = [memoryview(blocks[b]) for b in ids]
        headers = [self.codec.header(k, p) for k, p in zip(keys, payloads, strict=True)]
        if len(self._scratch) != value_bytes:
            self._scratch = bytearray(value_bytes)
        per_txn = max(1, _TXN_BYTES // value_bytes)
        for lo in range(0, len(keys), per_txn):
            chunk = slice(lo, lo + per_txn)
            written = self._put_chunk(keys[chunk], headers[chunk], payloads[chunk])
            results[chunk] = written
        return self.stats.count_put(results, blocks.shape[1])

    def get(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=True)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        payload_bytes = blocks.shape[1]
        results = [False] * len(keys)
        corrupt: list[bytes] = []
        sh = self._env()
        try:
            with sh.env.begin(db=sh.blocks, buffers=True) as txn:
                for i, (k, b) in enumerate(zip(keys, ids, strict=True)):
                    value = txn.get(self.shard_key(k))  # a view into the map, valid in this txn
                    if value is None:
                        continue
                    verdict = self.codec.verify(k, value, payload_bytes)
                    if verdict is not Verdict.OK:
                        log.warning("lmdb %s: corrupt value for key %s rank %d: %s", self.path, k.hex(),
                                    self.rank, verdict.name)
                        corrupt.append(k)
                        continue
                    blocks[b] = np.frombuffer(value, np.uint8, payload_bytes, HEADER_BYTES)
                    results[i] = True
        except lmdb.Error as e:
            self._failed("get", e)  # blocks copied before the error stay loaded and True
        self.stats.count_get(results, payload_bytes)
        tick = self._tick()
        for k, ok in zip(keys, results, strict=True):
            if ok:
                self._touches[k] = tick
        if corrupt:
            self.stats.corrupt += len(corrupt)
            self._write(lambda txn, used: self._drop_corrupt(txn, used, corrupt, payload_bytes), "drop corrupt")
        elif len(self._touches) >= _TOUCH_FLUSH:
            self.flush()
        return results

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        self._write(lambda txn, used: self._delete_shards(txn, used, keys), "delete")

    def flush(self) -> None:
        """Writes the access ticks of recent hits into the LRU record."""
        if self._touches:
            self._write(lambda txn, used: used, "flush")

    def check(self) -> None:
        """An empty write transaction: raises if the environment cannot be written."""
        with self._env().env.begin(write=True):
            pass

    def close(self) -> None:
        if self._shared is None:
            return
        self.flush()
        self._shared = None
        _release_env(self.path)

    # --- inspection (tests, metrics) --------------------------------------------------------

    def used_bytes(self) -> int:
        sh = self._env()
        with sh.env.begin(db=sh.meta) as txn:
            return _read_used(txn, sh)

    def families_lru(self) -> list[bytes]:
        """Family keys, least recently used first."""
        sh = self._env()
        with sh.env.begin(db=sh.lru) as txn:
            return [k[8:] for k in txn.cursor().iternext(keys=True, values=False)]

    def get_raw(self, key: bytes) -> bytes | None:
        """This rank's stored value for ``key``, unverified (tests, debugging)."""
        sh = self._env()
        with sh.env.begin(db=sh.blocks) as txn:
            return txn.get(self.shard_key(key))

    def put_raw(self, key: bytes, value: bytes) -> None:
        """Stores ``value`` as-is under this rank's shard of ``key``, with accounting (tests)."""

        def body(txn, used: int) -> int:
            tick = self._tick()
            used = self._delete_shards(txn, used, [key])
            txn.put(self.shard_key(key), value, db=self._shared.blocks)
            self._set_family(txn, key, tick, len(value))
            return used + len(value)

        self._write(body, "put raw")

    def check_integrity(self) -> None:
        """Asserts the accounting: shards, family records, LRU entries and ``used`` agree."""
        sh = self._env()
        with sh.env.begin(buffers=True) as txn:
            sums: dict[bytes, int] = {}
            for shard, value in txn.cursor(db=sh.blocks):
                assert len(shard) == KEY_BYTES + 2, f"shard key of {len(shard)} bytes in blocks"
                fam = bytes(shard[:KEY_BYTES])
                sums[fam] = sums.get(fam, 0) + len(value)
            records = {bytes(fam): _FAMILY.unpack(rec) for fam, rec in txn.cursor(db=sh.families)}
            assert records.keys() == sums.keys(), (
                f"families without shards: {len(records.keys() - sums.keys())}, "
                f"shards without a family record: {len(sums.keys() - records.keys())}"
            )
            for fam, (_tick, nbytes) in records.items():
                assert nbytes == sums[fam], f"family {fam.hex()} records {nbytes} bytes, holds {sums[fam]}"
            lru = [(int.from_bytes(k[:8], "big"), bytes(k[8:])) for k in txn.cursor(db=sh.lru).iternext(values=False)]
            assert sorted((tick, fam) for fam, (tick, _) in records.items()) == lru, "lru index != family ticks"
            used = _read_used(txn, sh)
            assert used == sum(sums.values()), f"used={used} but values total {sum(sums.values())}"
            assert used <= self.max_bytes, f"used={used} exceeds max_bytes={self.max_bytes}"

    # --- write transactions -------------------------------------------------------------

    def _env(self) -> _Env:
        if self._shared is None:
            raise ValueError(f"LMDBStore({self.path!r}) is closed")
        return self._shared

    def _tick(self) -> int:
        # Wall-clock ns, so ticks of different processes compare; strictly increasing in a process.
        global _last_tick
        _last_tick = max(time.time_ns(), _last_tick + 1)
        return _last_tick

    def _failed(self, op: str, err: Exception) -> None:
        self.stats.errors += 1
        log.error("lmdb %s: %s failed: %s", self.path, op, err)

    def _write(self, body, op: str, map_full_raises: bool = False) -> set[bytes] | None:
        """Runs ``body(txn, used) -> used`` in a write transaction after applying pending
        touches; enforces the bound and stores ``used``. Returns the evicted family keys,
        None if the transaction failed (logged and counted).
        Buffers from the transaction are views valid until its next write: use them at once."""
        sh = self._env()
        try:
            with sh.env.begin(write=True, buffers=True) as txn:
                used = _read_used(txn, sh)
                for fam, tick in self._touches.items():
                    self._set_family(txn, fam, tick, 0)
                used = body(txn, used)
                evicted = set()
                lru = txn.cursor(db=sh.lru)
                while used > self.max_bytes and lru.first():
                    fam = bytes(lru.key()[8:])
                    used -= self._drop_family(txn, fam)
                    evicted.add(fam)
                txn.put(_USED, used.to_bytes(8, "little"), db=sh.meta)
            self._touches.clear()
            return evicted
        except lmdb.Error as e:
            if map_full_raises and isinstance(e, lmdb.MapFullError):
                raise
            self._failed(op, e)
            return None

    def _put_chunk(self, keys, headers, payloads) -> list[bool]:
        """One write transaction; which blocks it stored."""
        try:
            evicted = self._put_txn(keys, headers, payloads)
        except lmdb.MapFullError:
            # The map is full of fragmented free pages, or a dead reader pins old pages:
            # clear stale readers, make room beyond the bound, and try once more.
            self._env().env.reader_check()
            self._make_room(len(self._scratch) * len(keys) + self.max_bytes // 8)
            try:
                evicted = self._put_txn(keys, headers, payloads)
            except lmdb.MapFullError as e:
                self._failed("put", e)
                evicted = None
        if evicted is None:
            return [False] * len(keys)
        return [k not in evicted for k in keys]  # more than the bound in one batch evicts some of itself

    def _put_txn(self, keys, headers, payloads) -> set[bytes] | None:
        scratch = self._scratch
        payload_at = np.frombuffer(scratch, np.uint8, offset=HEADER_BYTES)  # numpy copies without the GIL

        def body(txn, used: int) -> int:
            # The tick is taken under the write lock: taken before it, a process that waited
            # for the lock would stamp its blocks older than what others wrote meanwhile, and
            # could evict them in the same transaction.
            tick = self._tick()
            sh = self._shared
            for k, header, payload in zip(keys, headers, payloads, strict=True):
                scratch[:HEADER_BYTES] = header
                payload_at[:] = payload  # a bytearray slice copy would hold the GIL (and the swap lane) for it
                shard = self.shard_key(k)
                old = txn.get(shard, db=sh.blocks)
                delta = len(scratch) - (len(old) if old is not None else 0)
                txn.put(shard, scratch, db=sh.blocks)
                self._set_family(txn, k, tick, delta)
                used += delta
            return used

        return self._write(body, "put", map_full_raises=True)

    def _set_family(self, txn, fam: bytes, tick: int, delta: int) -> None:
        """Moves ``fam`` to ``tick`` (never back in time) and adds ``delta`` to its bytes.
        A touch (delta 0) of a family that is gone is dropped."""
        sh = self._shared
        rec = txn.get(fam, db=sh.families)
        if rec is None:
            if delta == 0:
                return
            old_tick, nbytes = 0, 0
        else:
            old_tick, nbytes = _FAMILY.unpack(rec)
            txn.delete(old_tick.to_bytes(8, "big") + fam, db=sh.lru)
        tick = max(tick, old_tick)
        nbytes += delta
        assert nbytes >= 0, f"family {fam.hex()} would hold {nbytes} bytes"
        if nbytes == 0:
            txn.delete(fam, db=sh.families)
            return
        txn.put(fam, _FAMILY.pack(tick, nbytes), db=sh.families)
        txn.put(tick.to_bytes(8, "big") + fam, b"", db=sh.lru)

    def _drop_family(self, txn, fam: bytes) -> int:
        """Deletes every rank's shard of ``fam`` and its records; returns the bytes freed."""
        sh = self._shared
        freed = 0
        cur = txn.cursor(db=sh.blocks)
        if cur.set_range(fam):
            while cur.key()[:KEY_BYTES] == fam:
                freed += len(cur.value())
                if not cur.delete():  # delete() moves to the next record; False at the end
                    break
        rec = txn.get(fam, db=sh.families)
        if rec is not None:
            tick, _ = _FAMILY.unpack(rec)
            txn.delete(fam, db=sh.families)
            txn.delete(tick.to_bytes(8, "big") + fam, db=sh.lru)
        return freed

    def _delete_shards(self, txn, used: int, keys: Sequence[bytes]) -> int:
        sh = self._shared
        for k in keys:
            shard = self.shard_key(k)
            old = txn.get(shard, db=sh.blocks)
            if old is not None:
                txn.delete(shard, db=sh.blocks)
                self._set_family(txn, k, 0, -len(old))
                used -= len(old)
        return used

    def _drop_corrupt(self, txn, used: int, keys: list[bytes], payload_bytes: int) -> int:
        # Re-verify under the write lock: another rank process may have rewritten the key.
        sh = self._shared
        still_bad = [k for k in keys if (v := txn.get(self.shard_key(k), db=sh.blocks)) is not None
                     and self.codec.verify(k, v, payload_bytes) is not Verdict.OK]
        return self._delete_shards(txn, used, still_bad)

    def _make_room(self, nbytes: int) -> None:
        """Evicts LRU families until ``nbytes`` more would fit under the bound."""
        limit = max(0, self.max_bytes - nbytes)

        def body(txn, used: int) -> int:
            lru = txn.cursor(db=self._shared.lru)
            while used > limit and lru.first():
                used -= self._drop_family(txn, bytes(lru.key()[8:]))
            return used

        self._write(body, "make room")


def _read_used(txn, sh: _Env) -> int:
    raw = txn.get(_USED, db=sh.meta)
    return int.from_bytes(raw, "little") if raw is not None else 0


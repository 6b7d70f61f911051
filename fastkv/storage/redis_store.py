"""Distributed storage tier: a Redis (or Valkey) server shared by many engines as one pool.

Keys are ``<prefix>:<block key hex>:<rank>``; values are header + payload (base.py), so a
value from another namespace, rank or key is a miss even if two engines' keys collide.
Batches go out as pipelines of at most ``max_batch_bytes`` (default 8 MiB: a few block
values in flight hide the round trip; deeper pipelines only grow the server's reply buffers
and run slower); the block-sized SET and GET pipelines bypass redis-py's copies
(redis_wire.py).
Capacity and eviction are the server's: run it with ``maxmemory`` and
``maxmemory-policy allkeys-lru`` (an evicted shard is a miss for its whole family).

Failure: every socket wait (connect, send, receive) has ``timeout``; redis-py's own retries
are off. A failed batch returns misses / False and opens a circuit: for ``backoff``
seconds (doubling per consecutive failure up to ``max_backoff``) operations return at
once without touching the network, then the next operation tries the server again. A
server that comes back is therefore picked up without anyone restarting anything, and a
dead one costs each caller at most one timeout per backoff period.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import numpy as np
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from fastkv.storage.base import HEADER_BYTES, StorageBackend, Verdict, check_batch, check_keys, host_blocks
from fastkv.storage.redis_wire import Wire

log = logging.getLogger(__name__)

# Deletes a corrupt value only if it is still the one that was read (same length, same
# first bytes: the header, checksum included), so a fresh value that another engine wrote
# in the meantime survives.
_DELETE_IF_SAME = """
if redis.call('STRLEN', KEYS[1]) == tonumber(ARGV[2]) and redis.call('GETRANGE', KEYS[1], 0, 127) == ARGV[1] then
    return redis.call('DEL', KEYS[1])
end
return 0
"""

_FAILURES = (redis.RedisError, OSError)


class RedisStore(StorageBackend):
    """One rank's view of a Redis pool (see the module docstring)."""

    def __init__(
        self,
        url: str,
        namespace: bytes,
        rank: int = 0,
        tp_size: int = 1,
        *,
        timeout: float = 1.0,
        backoff: float = 0.5,
        max_backoff: float = 5.0,
        ttl: int | None = None,
        prefix: str = "fkv",
        max_batch_bytes: int = 8 << 20,
    ) -> None:
        super().__init__(namespace, rank, tp_size)
        for name, value in (("timeout", timeout), ("backoff", backoff), ("max_backoff", max_backoff)):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        if ttl is not None and (not isinstance(ttl, int) or ttl <= 0):
            raise ValueError(f"ttl must be a positive int of seconds or None, got {ttl!r}")
        if not isinstance(max_batch_bytes, int) or max_batch_bytes <= 0:
            raise ValueError(f"max_batch_bytes must be a positive int, got {max_batch_bytes!r}")
        self.timeout = float(timeout)
        self.backoff = float(backoff)
        self.max_backoff = float(max_backoff)
        self.ttl = ttl
        self.max_batch_bytes = max_batch_bytes
        self._prefix = f"{prefix}:".encode()
        self._suffix = f":{rank}".encode()
        # No connection is made here: a server that is down at start-up is just a miss.
        self._pool = redis.ConnectionPool.from_url(
            url,
            socket_timeout=self.timeout,
            socket_connect_timeout=self.timeout,
            retry=Retry(NoBackoff(), 0),
            socket_read_size=1 << 20,  # 2 MiB values: fewer recv calls than the 64 KiB default
            health_check_interval=0,
            protocol=2,  # RESP2: no push messages interleaved with the raw replies of redis_wire
        )
        self._client = redis.Redis(connection_pool=self._pool)
        self._wire = Wire(self._pool)
        self._delete_if_same = self._client.register_script(_DELETE_IF_SAME)
        self._failures = 0
        self._down_until = 0.0

    # --- the interface -------------------------------------------------------------------

    def check(self) -> None:
        self._client.ping()

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        if not keys or not self._available():
            return [False] * len(keys)
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys:
                pipe.exists(self._rkey(k))
            found = [r == 1 for r in pipe.execute()]
        except _FAILURES as e:
            self._failed("exists", e)
            return [False] * len(keys)
        self._ok()
        return found

    def put(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=False)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        results = [False] * len(keys)
        if keys and self._available():
            per_pipe = max(1, self.max_batch_bytes // (HEADER_BYTES + blocks.shape[1]))
            for lo in range(0, len(keys), per_pipe):
                if not self._put_chunk(keys, blocks, ids, lo, lo + per_pipe, results):
                    break
        return self.stats.count_put(results, blocks.shape[1])

    def get(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=True)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        results = [False] * len(keys)
        if keys and self._available():
            per_pipe = max(1, self.max_batch_bytes // (HEADER_BYTES + blocks.shape[1]))
            for lo in range(0, len(keys), per_pipe):
                if not self._get_chunk(keys, blocks, ids, lo, lo + per_pipe, results):
                    break
        return self.stats.count_get(results, blocks.shape[1])

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if not keys or not self._available():
            return
        try:
            self._client.delete(*[self._rkey(k) for k in keys])
        except _FAILURES as e:
            self._failed("delete", e)
            return
        self._ok()

    def close(self) -> None:
        self._pool.disconnect()

    def get_raw(self, key: bytes) -> bytes | None:
        """This rank's stored value for ``key``, unverified (tests, debugging). May raise."""
        return self._client.get(self._rkey(key))

    def put_raw(self, key: bytes, value: bytes) -> None:
        """Stores ``value`` as-is under this rank's shard of ``key`` (tests). May raise."""
        self._client.set(self._rkey(key), value)

    # --- internals ---------------------------------------------------------------------

    def _rkey(self, key: bytes) -> bytes:
        return self._prefix + key.hex().encode() + self._suffix

    def _put_chunk(self, keys, blocks, ids, lo: int, hi: int, results: list[bool]) -> bool:
        items = []
        for k, b in zip(keys[lo:hi], ids[lo:hi], strict=True):
            payload = memoryview(blocks[b])
            items.append((self._rkey(k), self.codec.header(k, payload), payload))
        try:
            replies = self._wire.set_many(items, self.ttl)
        except _FAILURES as e:
            self._failed("put", e)
            return False
        self._ok()
        rejected = [r for r in replies if r is not True]  # e.g. OOM under maxmemory noeviction
        if rejected:
            self.stats.errors += 1
            log.warning("redis put: %d of %d values refused: %s", len(rejected), len(replies), rejected[0])
        for i, r in enumerate(replies, lo):
            results[i] = r is True
        return True

    def _get_chunk(self, keys, blocks, ids, lo: int, hi: int, results: list[bool]) -> bool:
        payload_bytes = blocks.shape[1]
        corrupt = []

        def consume(j: int, value) -> None:
            i = lo + j
            if isinstance(value, str):  # an error reply, e.g. WRONGTYPE: not a block of ours
                log.warning("redis: GET of key %s rank %d answered %s", keys[i].hex(), self.rank, value)
                corrupt.append((keys[i], b"", -1))
                return
            verdict = self.codec.verify(keys[i], value, payload_bytes)
            if verdict is not Verdict.OK:
                log.warning("redis: corrupt value for key %s rank %d: %s", keys[i].hex(), self.rank, verdict.name)
                corrupt.append((keys[i], bytes(value[:HEADER_BYTES]), len(value)))
                return
            blocks[ids[i]] = np.frombuffer(value, np.uint8, payload_bytes, HEADER_BYTES)
            results[i] = True

        try:
            self._wire.get_many([self._rkey(k) for k in keys[lo:hi]], HEADER_BYTES + payload_bytes, consume)
        except _FAILURES as e:
            self._failed("get", e)
            return False  # blocks verified and copied before the failure stay loaded and True
        self._ok()
        if corrupt:
            self.stats.corrupt += len(corrupt)
            self._drop_corrupt(corrupt)
        return True

    def _drop_corrupt(self, corrupt: list[tuple[bytes, bytes, int]]) -> None:
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, head, length in corrupt:
                if length < 0:
                    pipe.delete(self._rkey(k))
                else:
                    self._delete_if_same(keys=[self._rkey(k)], args=[head, length], client=pipe)
            pipe.execute()
        except _FAILURES as e:
            self._failed("delete corrupt", e)

    def _available(self) -> bool:
        if time.monotonic() >= self._down_until:
            return True
        self.stats.skipped += 1
        return False

    def _failed(self, op: str, err: Exception) -> None:
        self.stats.errors += 1
        self._failures += 1
        delay = min(self.backoff * 2 ** min(self._failures - 1, 30), self.max_backoff)
        self._down_until = time.monotonic() + delay
        if self._failures == 1:
            log.error("redis %s failed (%s: %s); treating the store as down for %.2fs, then retrying",
                      op, type(err).__name__, err, delay)

    def _ok(self) -> None:
        if self._failures:
            log.warning("redis store is back after %d failed attempts", self._failures)
            self._failures = 0

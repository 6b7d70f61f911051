"""Storage tier on Mooncake's distributed store (FastDeploy's global cache pool).

Needs the ``mooncake`` extra (``pip install -e '.[mooncake]'``: the CPU build of the
Mooncake client) and Debian's ``libibverbs1``; elsewhere constructing ``MooncakeStore``
raises ImportError saying so. Settings and URL: mooncake_config.py.

Each operation is one batched Mooncake call: ``batch_is_exist``; ``batch_put_from_multi_buffers``
(the header from a small staging array, the payload straight from the host block: no join
copy); ``batch_get_into_multi_buffers`` the same way back, the header into the staging array and
the payload straight into the LOAD's host block, verified there (no staging copy of the block:
``lands_in_place``, base.py). A value of another length fails that split get like a lost segment
(TRANSFER_FAIL), so those keys are asked again whole into a staging array, which tells a corrupt
value (a miss, deleted) from a lost one. The host tier and the staging arrays are registered
with ``register_buffer``, so transfers go straight from and to them (RDMA needs that; TCP is
simply faster for it).

What the pool does: objects live in the segments of the processes that lend memory
(``global_segment_size``) and die with them; a value whose segment is gone is a miss
(TRANSFER_FAIL, counted in ``errors``). A full pool evicts by the master's own policy, and
what it evicted is a plain miss. A value read is leased by the master for
``--default_kv_lease_ttl``; ``delete`` removes what is not leased, then forces the rest
(a reader still inside its lease verifies the checksum, so it sees a miss, never other bytes).

Failure: a call that fails at the master (RPC_FAIL and the like) returns misses / False,
counts an error and opens a circuit like the Redis backend's: for ``backoff`` seconds
(doubling up to ``max_backoff``) operations return at once, then the next one tries again.
"""
from __future__ import annotations

import itertools
import logging
import socket
import time
import uuid
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

from fastkv.storage.base import HEADER_BYTES, StorageBackend, Verdict, check_batch, check_keys, host_blocks

log = logging.getLogger(__name__)

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as e:  # no Mooncake on this machine (or no libibverbs1)
    MooncakeDistributedStore = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

AVAILABLE = MooncakeDistributedStore is not None

# Mooncake's ErrorCode values that mean "not there (any more)": a plain miss.
_ABSENT = {-704, -703, -710, -712}  # OBJECT_NOT_FOUND, REPLICA_IS_NOT_READY, REPLICA_NOT_FOUND, REPLICA_IS_GONE
# LEASE_EXPIRED: the read outlasted the master's lease, so the value may have been evicted under
# it and Mooncake dropped what it read; a miss (a lease shorter than a batch's transfer repeats it)
_LEASE_EXPIRED = -707
_TOO_SMALL = -600  # INVALID_PARAMS: get_into a buffer shorter than the value
_HAS_LEASE = -706
_TRANSFER_FAIL = -800  # the segment holding the value is gone (its process died)
_NO_SPACE = -200  # NO_AVAILABLE_HANDLE: the pool is full (nothing evictable yet)
_REGISTERED_HOSTS = 4  # host arrays kept registered at once (the host tier is one; tests make many)


def _require() -> None:
    if MooncakeDistributedStore is None:
        raise ImportError("the mooncake storage tier needs the Mooncake client: pip install -e '.[mooncake]' and "
                          f"Debian's libibverbs1 (importing mooncake.store failed: {_IMPORT_ERROR})")


def check_reachable(address: str, timeout: float) -> None:
    """One TCP connect to the master: Mooncake's own setup waits about 90 s for one that is down."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as exc:
        raise ConnectionError(f"Mooncake master {address} is not reachable within {timeout:g} s "
                              f"({exc.strerror or exc})") from None


class MooncakeStore(StorageBackend):
    """One rank's view of a Mooncake pool; the keyword arguments are FastDeploy's keys."""

    overwrites = False  # Mooncake objects are immutable: a put of a stored key keeps it
    lands_in_place = True  # get: the payload lands in its host block before its checksum is checked

    def __init__(
        self,
        namespace: bytes,
        rank: int = 0,
        tp_size: int = 1,
        *,
        master_server_addr: str,
        metadata_server: str = "P2PHANDSHAKE",
        local_hostname: str = "127.0.0.1",
        protocol: str = "tcp",
        rdma_devices: str = "",
        global_segment_size: int = 0,
        local_buffer_size: int = 16 << 20,
        prefix: str = "fkv",
        backoff: float = 0.5,
        max_backoff: float = 5.0,
        connect_timeout: float = 1.0,
    ) -> None:
        _require()
        super().__init__(namespace, rank, tp_size)
        for name, value in (("backoff", backoff), ("max_backoff", max_backoff), ("connect_timeout", connect_timeout)):
            if not isinstance(value, int | float) or value <= 0:
                raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")
        self.backoff, self.max_backoff = float(backoff), float(max_backoff)
        self.master, self.metadata_server = master_server_addr, metadata_server
        self._prefix = prefix
        self._suffix = f":{rank}"
        self._store = None
        self._hosts: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._headers = np.zeros(0, np.uint8)
        self._stage = np.zeros(0, np.uint8)
        self._failures = 0
        self._down_until = 0.0
        devices = [d.strip() for d in rdma_devices.split(",") if d.strip()]
        device = devices[rank % len(devices)] if devices else ""  # one NIC per rank, as FastDeploy picks
        check_reachable(master_server_addr, connect_timeout)
        store = MooncakeDistributedStore()
        ret = store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size, protocol,
                          device, master_server_addr)
        if ret != 0:
            raise ConnectionError(f"Mooncake setup failed with code {ret} (master {master_server_addr}, metadata "
                                  f"{metadata_server}, protocol {protocol}, local_hostname {local_hostname})")
        self._store = store

    # --- the interface -------------------------------------------------------------------

    def check(self) -> None:
        """A value written through the pool and read back: a master that answers is not enough,
        some holder must lend memory this client can reach (same metadata server, reachable
        hostname), or every STORE of the run would fail."""
        codes = self._store.batch_is_exist([self._mkey(bytes(32))])
        if codes[0] < 0:
            raise ConnectionError(f"Mooncake master {self.master} answered a lookup with code {codes[0]}")
        key, value = f"{self._prefix}:probe:{uuid.uuid4().hex}{self._suffix}", uuid.uuid4().bytes * 4
        ret = self._store.put(key, value)
        try:
            got = bytes(self._store.get(key) or b"") if ret == 0 else b""
        finally:
            self._store.remove(key, True)
        if ret != 0 or got != value:
            how = f"a put failed with code {ret}" if ret != 0 else "a value put was not read back"
            raise ConnectionError(
                f"the Mooncake pool of master {self.master} cannot hold a value ({how}): no holder lends memory "
                f"this engine can reach; start one with the engines' settings: python -m "
                f"fastkv.storage.mooncake_holder {self.master} 4G --metadata-server {self.metadata_server}")

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        if not keys or not self._available():
            return [False] * len(keys)
        codes = self._store.batch_is_exist([self._mkey(k) for k in keys])
        if any(c < 0 for c in codes):
            self._failed("exists", min(codes))
            return [False] * len(keys)
        self._ok()
        return [c == 1 for c in codes]

    def put(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=False)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        n, size = len(keys), blocks.shape[1]
        if not n or not self._available():
            return self.stats.count_put([False] * n, size)
        base = self._register_host(blocks)
        headers = self._header_rows(n)
        for i, (k, b) in enumerate(zip(keys, ids, strict=True)):
            headers[i] = np.frombuffer(self.codec.header(k, memoryview(blocks[b])), np.uint8)
        hbase = headers.ctypes.data
        codes = self._store.batch_put_from_multi_buffers(
            [self._mkey(k) for k in keys], [[hbase + i * HEADER_BYTES, base + b * size] for i, b in enumerate(ids)],
            [[HEADER_BYTES, size]] * n)
        results = [c == 0 for c in codes]
        if not all(results):
            worst = min(codes)
            if all(c in (0, _NO_SPACE, _TRANSFER_FAIL) for c in codes):  # the pool is full or a segment is gone
                self.stats.errors += 1
                log.warning("mooncake put: %d of %d values refused (code %d)", n - sum(results), n, worst)
            else:
                self._failed("put", worst)
        else:
            self._ok()
        return self.stats.count_put(results, size)

    def get(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=True)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        n, size = len(keys), blocks.shape[1]
        results = [False] * n
        if not n or not self._available():
            return self.stats.count_get(results, size)
        if len(set(ids)) < n:  # two values into one block would land together: in runs, the later wins
            runs, seen = [0], set()
            for i, b in enumerate(ids):
                if b in seen:
                    runs.append(i)
                    seen.clear()
                seen.add(b)
            runs.append(n)
            return [ok for lo, hi in itertools.pairwise(runs) for ok in self.get(keys[lo:hi], host, ids[lo:hi])]
        base = self._register_host(blocks)
        headers = self._header_rows(n)
        hbase = headers.ctypes.data
        mkeys = [self._mkey(k) for k in keys]
        # the header lands beside, the payload straight in its host block (lands_in_place)
        codes = self._store.batch_get_into_multi_buffers(
            mkeys, [[hbase + i * HEADER_BYTES, base + b * size] for i, b in enumerate(ids)], [[HEADER_BYTES, size]] * n)
        # a value of another length fails the split get as a lost segment does: asked again whole
        staged = {i: j for j, i in enumerate(i for i, c in enumerate(codes) if c == _TRANSFER_FAIL)}
        if staged:
            stage = self._stage_rows(len(staged), HEADER_BYTES + size)
            again = self._store.batch_get_into([mkeys[i] for i in staged], [row.ctypes.data for row in stage],
                                               [HEADER_BYTES + size] * len(staged))
            for i, j in staged.items():
                codes[i] = again[j]
        corrupt, lost, failed, expired = [], [], 0, 0
        for i, code in enumerate(codes):
            if code >= 0:
                if i in staged:  # read whole the second time (usually of another length: a miss)
                    verdict = self.codec.verify(keys[i], stage[staged[i], :code], size)
                    if verdict is Verdict.OK:
                        blocks[ids[i]] = stage[staged[i], HEADER_BYTES:]
                else:
                    verdict = self.codec.verify_split(keys[i], headers[i], blocks[ids[i]], code, size)
            elif code == _TOO_SMALL:
                verdict = Verdict.LENGTH  # longer than header + block: not one of ours
            elif code in _ABSENT:
                continue
            elif code == _LEASE_EXPIRED:
                expired += 1
                continue
            elif code == _TRANSFER_FAIL:
                lost.append(keys[i])
                continue
            else:
                failed = failed or code
                continue
            if verdict is Verdict.OK:
                results[i] = True
            else:
                log.warning("mooncake: corrupt value for key %s rank %d: %s", keys[i].hex(), self.rank, verdict.name)
                corrupt.append(keys[i])
        if failed:
            self._failed("get", failed)
        else:
            self._ok()
            if lost:  # their segment's process died: misses, counted once per batch
                self.stats.errors += 1
                log.warning("mooncake get: %d of %d values lost with their segment", len(lost), n)
                # the master lists them until it drops the dead segment, and a put of a listed key
                # stores nothing: remove them so that the next put stores them again
                self._store.batch_remove([self._mkey(k) for k in lost], True)
        if expired:
            log.warning("mooncake get: %d of %d reads outlasted the master's lease (--default_kv_lease_ttl); misses",
                        expired, n)
        if corrupt:
            self.stats.corrupt += len(corrupt)
            self._remove([self._mkey(k) for k in corrupt], force=True)
        return self.stats.count_get(results, size)

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        if keys and self._available():
            self._remove([self._mkey(k) for k in keys], force=False)

    def close(self) -> None:
        if self._store is None:
            return
        store, self._store = self._store, None
        for ptr, _ in self._hosts:
            store.unregister_buffer(ptr)
        for arr in (self._headers, self._stage):
            if arr.size:
                store.unregister_buffer(arr.ctypes.data)
        self._hosts.clear()
        store.close()

    def get_raw(self, key: bytes) -> bytes | None:
        """This rank's stored value for ``key``, unverified (tests, debugging)."""
        value = self._store.get(self._mkey(key))
        return bytes(value) if value else None

    def put_raw(self, key: bytes, value: bytes) -> None:
        """Stores ``value`` as-is under this rank's shard of ``key``, replacing what is there (tests).
        Mooncake holds no empty values: ValueError for one."""
        if not value:
            raise ValueError("Mooncake stores no empty values")
        self._store.remove(self._mkey(key), True)
        ret = self._store.put(self._mkey(key), value)
        if ret != 0:
            raise ConnectionError(f"Mooncake put of {len(value)} bytes failed with code {ret}")

    # --- internals ---------------------------------------------------------------------

    def _mkey(self, key: bytes) -> str:
        return f"{self._prefix}:{key.hex()}{self._suffix}"

    def _remove(self, mkeys: list[str], force: bool) -> None:
        codes = self._store.batch_remove(mkeys, force)
        leased = [k for k, c in zip(mkeys, codes, strict=True) if c == _HAS_LEASE]
        if leased:  # read within the lease: a reader still inside it fails its checksum, never serves these
            codes = [c for c in codes if c != _HAS_LEASE] + self._store.batch_remove(leased, True)
        bad = [c for c in codes if c < 0 and c not in _ABSENT]
        if bad:
            self._failed("delete", min(bad))
        else:
            self._ok()

    def _register_host(self, blocks: np.ndarray) -> int:
        """Registers the host array once (its owner keeps it alive; so do we while registered)."""
        ptr, size = blocks.ctypes.data, blocks.nbytes
        if (ptr, size) in self._hosts:
            self._hosts.move_to_end((ptr, size))
            return ptr
        if self._store.register_buffer(ptr, size) != 0:
            log.warning("mooncake: register_buffer of %d bytes failed; transfers go through its own buffer", size)
        self._hosts[(ptr, size)] = blocks
        while len(self._hosts) > _REGISTERED_HOSTS:
            (old, _), _ = self._hosts.popitem(last=False)
            self._store.unregister_buffer(old)
        return ptr

    def _grow(self, current: np.ndarray, nbytes: int) -> np.ndarray:
        if current.size >= nbytes:
            return current
        if current.size:
            self._store.unregister_buffer(current.ctypes.data)
        fresh = np.zeros(max(nbytes, 2 * current.size), np.uint8)
        if self._store.register_buffer(fresh.ctypes.data, fresh.nbytes) != 0:
            log.warning("mooncake: register_buffer of %d bytes failed", fresh.nbytes)
        return fresh

    def _header_rows(self, n: int) -> np.ndarray:
        self._headers = self._grow(self._headers, n * HEADER_BYTES)
        return self._headers[: n * HEADER_BYTES].reshape(n, HEADER_BYTES)

    def _stage_rows(self, n: int, width: int) -> np.ndarray:
        self._stage = self._grow(self._stage, n * width)
        return self._stage[: n * width].reshape(n, width)

    def _available(self) -> bool:
        if time.monotonic() >= self._down_until:
            return True
        self.stats.skipped += 1
        return False

    def _failed(self, op: str, code: int) -> None:
        self.stats.errors += 1
        self._failures += 1
        delay = min(self.backoff * 2 ** min(self._failures - 1, 30), self.max_backoff)
        self._down_until = time.monotonic() + delay
        if self._failures == 1:
            log.error("mooncake %s failed (code %d, master %s); treating the store as down for %.2fs, then retrying",
                      op, code, self.master, delay)

    def _ok(self) -> None:
        if self._failures:
            log.warning("mooncake store is back after %d failed attempts", self._failures)
            self._failures = 0

"""Optional storage tier on Mooncake's distributed store (FastDeploy's choice).

Available only where ``mooncake.store`` imports (the Mooncake wheel plus ``libibverbs1``);
elsewhere constructing ``MooncakeStore`` raises ImportError saying so. Values use the
same header as every backend (base.py), so Mooncake's own integrity guarantees are not
relied upon. Untested in fastkv's CI, which has no Mooncake master: treat as a
starting point for a deployment that runs one.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence

import numpy as np

from fastkv.storage.base import HEADER_BYTES, StorageBackend, Verdict, check_batch, check_keys, host_blocks

log = logging.getLogger(__name__)

try:
    from mooncake.store import MooncakeDistributedStore
except ImportError as e:  # the common case: no Mooncake on this machine
    MooncakeDistributedStore = None
    _IMPORT_ERROR: ImportError | None = e
else:
    _IMPORT_ERROR = None

AVAILABLE = MooncakeDistributedStore is not None


class MooncakeStore(StorageBackend):
    """One rank's view of a Mooncake store; the arguments are those of Mooncake's ``setup``."""

    def __init__(
        self,
        namespace: bytes,
        rank: int = 0,
        tp_size: int = 1,
        *,
        local_hostname: str,
        metadata_server: str,
        master_server_address: str,
        protocol: str = "tcp",
        device_name: str = "",
        global_segment_size: int = 1 << 30,
        local_buffer_size: int = 1 << 30,
        prefix: str = "fkv",
    ) -> None:
        if MooncakeDistributedStore is None:
            raise ImportError(
                "the mooncake backend needs the Mooncake store module (pip install mooncake-transfer-engine "
                f"and Debian's libibverbs1); importing mooncake.store failed: {_IMPORT_ERROR}"
            )
        super().__init__(namespace, rank, tp_size)
        self._prefix = prefix
        self._store = MooncakeDistributedStore()
        ret = self._store.setup(local_hostname, metadata_server, global_segment_size, local_buffer_size,
                                protocol, device_name, master_server_address)
        if ret != 0:
            raise ConnectionError(f"Mooncake store setup failed with code {ret} (master {master_server_address})")

    def _mkey(self, key: bytes) -> str:
        return f"{self._prefix}:{key.hex()}:{self.rank}"

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        check_keys(keys)
        found = []
        for k in keys:
            ret = self._store.is_exist(self._mkey(k))
            if ret < 0:
                self.stats.errors += 1
            found.append(ret == 1)
        return found

    def put(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=False)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        results = []
        for k, b in zip(keys, ids, strict=True):
            payload = memoryview(blocks[b])
            ret = self._store.put(self._mkey(k), b"".join((self.codec.header(k, payload), payload)))
            if ret != 0:
                self.stats.errors += 1
            results.append(ret == 0)
        return self.stats.count_put(results, blocks.shape[1])

    def get(self, keys: Sequence[bytes], host: np.ndarray, block_ids) -> list[bool]:
        blocks = host_blocks(host, writable=True)
        ids = check_batch(keys, block_ids, blocks.shape[0])
        results = [False] * len(keys)
        for i, (k, b) in enumerate(zip(keys, ids, strict=True)):
            value = self._store.get(self._mkey(k))
            if not value:  # Mooncake answers a miss (or a failure) with empty bytes
                continue
            verdict = self.codec.verify(k, value, blocks.shape[1])
            if verdict is not Verdict.OK:
                log.warning("mooncake: corrupt value for key %s rank %d: %s", k.hex(), self.rank, verdict.name)
                self.stats.corrupt += 1
                self._store.remove(self._mkey(k))
                continue
            blocks[b] = np.frombuffer(value, np.uint8, blocks.shape[1], HEADER_BYTES)
            results[i] = True
        return self.stats.count_get(results, blocks.shape[1])

    def delete(self, keys: Sequence[bytes]) -> None:
        check_keys(keys)
        for k in keys:
            self._store.remove(self._mkey(k))

    def close(self) -> None:
        close = getattr(self._store, "close", None)
        if close is not None:
            close()

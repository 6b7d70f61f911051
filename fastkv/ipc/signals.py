"""A named array of int64 signals in shared memory: heartbeats, ready flags, cache
status, pids. Every slot is read and written atomically (acquire loads, seq_cst stores,
fetch-add, CAS); a slot has one writer by convention, any number of readers.

Byte layout of the segment (little-endian):

    off      size      field
    0        8         magic b"FKVSIGS1" (written last by the creator)
    8        8         n: number of slots
    16       8         names_len: bytes of the names blob
    24       40        reserved
    64       names_len the slot names, UTF-8, "\\n"-separated, zero padded to 8
    64+pad   8 * n     the slots, int64, initially 0
"""
from __future__ import annotations

from collections.abc import Sequence

from fastkv.ipc.errors import ChannelClosed
from fastkv.ipc.namespace import Namespace
from fastkv.ipc.native import A

MAGIC = int.from_bytes(b"FKVSIGS1", "little")
HEADER = 64


class SignalArray:
    def __init__(self, ns: Namespace, local: str, mm) -> None:
        self.local, self._mm = local, mm
        self._pin = memoryview(mm)
        base = A.address(self._pin)
        if A.load(base) != MAGIC:
            raise ValueError(f"{ns.name(local)} is not a fastkv signal array (bad magic)")
        n, names_len = A.load(base + 8), A.load(base + 16)
        self.names = bytes(mm[HEADER:HEADER + names_len]).decode().split("\n") if n else []
        assert len(self.names) == n, f"signal array {local}: {n} slots but {len(self.names)} names"
        self._slots = base + HEADER + names_len + (-names_len % 8)
        self._index = {name: i for i, name in enumerate(self.names)}

    @classmethod
    def create(cls, ns: Namespace, local: str, names: Sequence[str]) -> SignalArray:
        names = list(names)
        if len(set(names)) != len(names) or any(not n or "\n" in n for n in names):
            raise ValueError(f"signal names must be unique, non-empty and without newlines: {names!r}")
        blob = "\n".join(names).encode()
        size = HEADER + len(blob) + (-len(blob) % 8) + 8 * len(names)
        mm = ns.create_shm(local, size)
        mm[8:16] = len(names).to_bytes(8, "little")
        mm[16:24] = len(blob).to_bytes(8, "little")
        mm[HEADER:HEADER + len(blob)] = blob
        mm[0:8] = MAGIC.to_bytes(8, "little")
        return cls(ns, local, mm)

    @classmethod
    def attach(cls, ns: Namespace, local: str) -> SignalArray:
        return cls(ns, local, ns.open_shm(local))

    def _addr(self, key: str | int) -> int:
        if self._pin is None:
            raise ChannelClosed(f"signal array {self.local!r} is closed in this process")
        i = self._index.get(key) if isinstance(key, str) else key
        if i is None or not isinstance(i, int) or not 0 <= i < len(self.names):
            raise KeyError(f"signal array {self.local!r} has no slot {key!r} (slots: {self.names})")
        return self._slots + 8 * i

    def __len__(self) -> int:
        return len(self.names)

    def __getitem__(self, key: str | int) -> int:
        return A.load(self._addr(key))

    def __setitem__(self, key: str | int, value: int) -> None:
        A.store(self._addr(key), value)

    def add(self, key: str | int, delta: int = 1) -> int:
        """Atomic fetch-add; returns the old value."""
        return A.add(self._addr(key), delta)

    def cas(self, key: str | int, expected: int, new: int) -> bool:
        return A.cas(self._addr(key), expected, new)

    def snapshot(self) -> dict[str, int]:
        return {name: self[i] for i, name in enumerate(self.names)}

    def close(self) -> None:
        if self._pin is not None:
            self._pin.release()
            self._pin = None
            self._mm.close()

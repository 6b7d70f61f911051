"""A tiny all-gather / all-reduce between the worker processes of one tensor-parallel group.

Shared memory ``/<prefix>`` (mode 0600), byte layout (little endian)::

    offset 0   u64 magic  = MAGIC
    offset 8   u32 world_size
    offset 12  u32 reserved (0)
    offset 16  u64 slot_bytes
    offset 64  buffers[2][world_size], each slot = u64 nbytes | slot_bytes payload

Semaphores ``/<prefix>.<src>to<dst>`` for every ordered pair of distinct ranks, initial 0.

Round ``k`` (every rank calls the collectives in the same order; each call is one or more
rounds) uses buffer ``k % 2``. Rank ``r`` writes ``nbytes`` and its payload into slot ``r``,
posts ``r->j`` for every other rank ``j``, then waits on ``j->r`` for every ``j`` and reads
slot ``j``. The post/wait pair orders the payload write before the peer's read. Per-pair
semaphores keep rounds apart (a fast peer's next post cannot be taken for a slow peer's
current one), and the two buffers keep a fast peer's round ``k+1`` write out of slot ``r``
of buffer ``k % 2`` until it has passed round ``k+1``, which needs every rank to have
finished reading round ``k``.

The creator (the supervisor, or a test) calls ``ShmCollective.create`` before the workers
``attach``; its ``close`` unlinks everything, and ``ShmCollective.unlink`` removes a crashed
run's objects. A wait that times out raises TimeoutError naming the late rank, and so may
the attacher's ``check`` (a dead peer, a stop); the collective is then unusable (ranks may
be in different rounds).
"""
from __future__ import annotations

import mmap
import struct
import time
from collections.abc import Callable

import numpy as np
import posix_ipc

from fastkv.ipc.semwait import acquire

MAGIC = 0x31_4C_4C_4F_43_56_4B_46  # b"FKVCOLL1" little endian
HEADER = 64
_HDR = struct.Struct("<QIIQ")


def _check_prefix(prefix: str) -> None:
    if not isinstance(prefix, str) or not prefix.startswith("fkv") or "/" in prefix:
        raise ValueError(f"collective prefix must start with 'fkv' and contain no '/', got {prefix!r}")


def _sem_name(prefix: str, src: int, dst: int) -> str:
    return f"/{prefix}.{src}to{dst}"


class ShmCollective:
    """One rank's handle (or the creator's, ``rank=None``) on a tp group's collective."""

    def __init__(self, prefix: str, rank: int | None, *, timeout_s: float = 60.0, _create: tuple | None = None,
                 slice_s: float | None = None, check: Callable[[int], None] | None = None):
        _check_prefix(prefix)
        self.prefix = prefix
        self.rank = rank
        self.timeout_s = float(timeout_s)
        self.slice_s = self.timeout_s if slice_s is None else float(slice_s)
        self.check = check  # check(j) between slices of a wait on rank j: raises if j is gone or the run stops
        self._owner = _create is not None
        self._round = 0
        if _create is not None:
            world_size, slot_bytes = _create
            size = HEADER + 2 * world_size * (8 + slot_bytes)
            shm = posix_ipc.SharedMemory("/" + prefix, posix_ipc.O_CREX, mode=0o600, size=size)
        else:
            try:
                shm = posix_ipc.SharedMemory("/" + prefix)
            except posix_ipc.ExistentialError as e:
                raise FileNotFoundError(f"collective {prefix!r} does not exist: create it before attaching") from e
        try:
            self._mm = mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()
        self._buf = np.frombuffer(self._mm, dtype=np.uint8)
        if _create is not None:
            _HDR.pack_into(self._mm, 0, MAGIC, world_size, 0, slot_bytes)
        magic, self.world_size, _, self.slot_bytes = _HDR.unpack_from(self._mm, 0)
        if magic != MAGIC:
            self.close()
            raise ValueError(f"/{prefix} is not a fastkv collective (magic {magic:#x})")
        if rank is not None and not 0 <= rank < self.world_size:
            self.close()
            raise ValueError(f"rank must be in [0, {self.world_size}), got {rank}")
        flags = posix_ipc.O_CREX if _create is not None else 0
        self._sems: dict[tuple[int, int], posix_ipc.Semaphore] = {}
        try:
            for src in range(self.world_size):
                for dst in range(self.world_size):
                    if src != dst and (rank is None or rank in (src, dst)):
                        self._sems[src, dst] = posix_ipc.Semaphore(
                            _sem_name(prefix, src, dst), flags, mode=0o600, initial_value=0
                        )
        except BaseException:
            self.close()
            raise

    @classmethod
    def create(cls, prefix: str, world_size: int, slot_bytes: int = 4 << 20) -> ShmCollective:
        """Create the segment and semaphores; the returned handle unlinks them at ``close``."""
        if world_size < 1 or slot_bytes < 1:
            raise ValueError(f"world_size and slot_bytes must be positive, got {world_size}, {slot_bytes}")
        _check_prefix(prefix)
        ShmCollective.unlink(prefix, world_size)  # a crashed run's leftovers under the same name
        return cls(prefix, None, _create=(world_size, slot_bytes))

    @classmethod
    def attach(cls, prefix: str, rank: int, timeout_s: float = 60.0, slice_s: float | None = None,
               check: Callable[[int], None] | None = None) -> ShmCollective:
        """A wait on a peer blocks in slices of ``slice_s`` and calls ``check(peer)`` between
        them, so a dead peer or a stop ends it at once rather than after ``timeout_s``."""
        return cls(prefix, rank, timeout_s=timeout_s, slice_s=slice_s, check=check)

    @staticmethod
    def names(prefix: str, world_size: int) -> list[str]:
        """Every shm object name of the collective (for a cleanup manifest)."""
        sems = [_sem_name(prefix, s, d) for s in range(world_size) for d in range(world_size) if s != d]
        return ["/" + prefix, *sems]

    @staticmethod
    def unlink(prefix: str, world_size: int) -> int:
        """Remove whatever of the collective exists; return how many objects were removed."""
        removed = 0
        for i, name in enumerate(ShmCollective.names(prefix, world_size)):
            try:
                (posix_ipc.unlink_shared_memory if i == 0 else posix_ipc.unlink_semaphore)(name)
                removed += 1
            except posix_ipc.ExistentialError:
                continue  # already gone: nothing to remove
        return removed

    def disown(self) -> None:
        """The creator hands the unlinking to someone else (a run namespace's manifest):
        ``close`` then only unmaps."""
        self._owner = False

    def _slot(self, parity: int, rank: int) -> int:
        return HEADER + (parity * self.world_size + rank) * (8 + self.slot_bytes)

    def _exchange(self, payload: np.ndarray) -> list[np.ndarray]:
        """One round: publish ``payload`` (uint8, <= slot_bytes), return every rank's bytes (copies)."""
        r = self.rank
        off = self._slot(self._round % 2, r)
        self._round += 1
        struct.pack_into("<Q", self._mm, off, len(payload))
        self._buf[off + 8 : off + 8 + len(payload)] = payload
        for j in range(self.world_size):
            if j != r:
                self._sems[r, j].release()
        out = []
        for j in range(self.world_size):
            if j == r:
                out.append(payload.copy())
                continue
            self._wait(j)
            o = off - (r - j) * (8 + self.slot_bytes)
            (n,) = struct.unpack_from("<Q", self._mm, o)
            out.append(self._buf[o + 8 : o + 8 + n].copy())
        return out

    def _wait(self, j: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"collective {self.prefix}: rank {self.rank} waited {self.timeout_s:.0f}s for "
                                   f"rank {j} (round {self._round - 1})")
            if acquire(self._sems[j, self.rank], min(self.slice_s, left)):
                return
            if self.check is not None:
                self.check(j)

    def all_gather(self, arr: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``arr`` (same shape and dtype on all ranks), in rank order."""
        if self.rank is None:
            raise ValueError("the creator's handle (rank=None) does not take part in collectives")
        arr = np.ascontiguousarray(arr)
        flat = arr.reshape(-1).view(np.uint8)
        parts: list[list[np.ndarray]] = [[] for _ in range(self.world_size)]
        # Large arrays go in several rounds; a 0-byte array still takes one (it is a barrier).
        for start in range(0, max(len(flat), 1), self.slot_bytes):
            for j, got in enumerate(self._exchange(flat[start : start + self.slot_bytes])):
                parts[j].append(got)
        out = []
        for j, p in enumerate(parts):
            data = np.concatenate(p)
            if len(data) != len(flat):
                raise ValueError(f"all_gather: rank {j} sent {len(data)} bytes, rank {self.rank} {len(flat)}")
            out.append(data.view(arr.dtype).reshape(arr.shape))
        return out

    def all_reduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """Sum of every rank's ``arr``, added in rank order so every rank gets identical bits."""
        parts = self.all_gather(arr)
        total = parts[0].copy()
        for p in parts[1:]:
            total += p
        return total

    def barrier(self) -> None:
        self.all_gather(np.empty(0, np.uint8))

    def close(self) -> None:
        """Unmap and close; the creator also unlinks every object."""
        for sem in getattr(self, "_sems", {}).values():
            sem.close()
        self._sems = {}
        if getattr(self, "_mm", None) is not None:
            self._buf = None  # the numpy view must go before the mmap can close
            self._mm.close()
            self._mm = None
        if self._owner:
            self._owner = False
            ShmCollective.unlink(self.prefix, self.world_size)

    def __enter__(self) -> ShmCollective:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

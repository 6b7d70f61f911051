"""The KV tensors of one rank, shared between the processes that use them.

Device tier: allocated by the rank's worker (``DeviceTier.create``), attached by the rank's
transfer process (``DeviceTier.attach``). Host tier: created by the supervisor
(``HostTier.create``) so that it outlives a transfer-process restart, attached by the
transfer process (``HostTier.attach``). Names come from the run's prefix (``fkv...``), so
the IPC layer's manifest and ``--cleanup`` find them: ``{prefix}kvdev{rank}`` and
``{prefix}kvhost{rank}``; both are POSIX shm objects, mode 0600. A sliding-window hybrid's host
tier is one segment per KV cache group, ``{prefix}kvhost{rank}g{group}``, each a host tier of
that group's layers alone (``KVLayout.group_layout``) with the group's host blocks: a group's
SWAP moves its layers between its device tensors and its own segment.

Byte layout of both segments::

    [0, 4096)  header, little-endian
        0    8  magic b"FKVTIER1", written last by the creator
        8    4  u32 kind: 1 device tier in shm, 2 device tier by CUDA IPC, 3 host tier
        12   4  u32 num_blocks
        16   8  u64 payload bytes
        24 256  KVLayout.describe(), utf-8, NUL padded: attach refuses another layout
    [4096, 4096 + payload)
        kind 1: per layer l, K[l] then V[l], each [num_blocks, kv_heads, block_size, head_dim]
        kind 2: JSON list of Paddle's CUDA IPC metadata (``_share_cuda``), K[0], V[0], K[1], ...
        kind 3: [num_blocks, layers, 2, kv_heads, block_size, head_dim]
        An MLA layout has no V: per layer the latent alone, and 1 for 2 in kind 3.
        ``layout.kv_pages`` tensors per layer.
    kind 3 only: [4096 + payload, + 16 * num_blocks) one checksum per host block
        (``block_checksum``), written by the transfer process when a block lands (SWAP_OUT,
        LOAD) and checked before it leaves (SWAP_IN, STORE): host memory that changed in
        between is a miss (DESIGN invariant 4). In the segment, so the checksums outlive a
        transfer-process restart like the blocks.

The creator writes everything, then the magic; an attacher runs after the creator has said
so over a semaphore-ordered channel, so it sees a complete segment. On a CPU build the
tensors are shm mapped into Paddle zero-copy through DLPack; on a GPU build the device tier
is CUDA memory opened from IPC handles, and the host tier is pinned with cudaHostRegister.
"""
from __future__ import annotations

import json
import mmap
import os
import re
import struct
from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import numpy as np
import posix_ipc
import xxhash

from fastkv.config import KVLayout
from fastkv.ipc.namespace import SHM_DIR

HEADER_BYTES = 4096
CHECKSUM_BYTES = 16  # per host block (block_checksum)
_MAGIC = b"FKVTIER1"
_HEADER = struct.Struct("<8sIIQ256s")
_PREFIX_RE = re.compile(r"fkv[A-Za-z0-9_.-]*")


class TierKind(IntEnum):
    DEVICE_SHM = 1
    DEVICE_CUDA_IPC = 2
    HOST = 3


def _check_prefix(prefix: str) -> str:
    if not isinstance(prefix, str) or not _PREFIX_RE.fullmatch(prefix):
        raise ValueError(f"name prefix must start with 'fkv' and use only [A-Za-z0-9_.-], got {prefix!r}")
    return prefix


def device_tier_name(prefix: str, rank: int) -> str:
    return f"{_check_prefix(prefix)}kvdev{int(rank)}"


def host_tier_name(prefix: str, rank: int, group: int | None = None) -> str:
    """``group``: a hybrid's KV cache group, whose host blocks are a segment of their own."""
    return f"{_check_prefix(prefix)}kvhost{int(rank)}" + ("" if group is None else f"g{int(group)}")


class ShmSegment:
    """One POSIX shared-memory object mapped into this process (``buf``: a shared mmap)."""

    def __init__(self, name: str, size: int | None = None, *, create: bool, populate: bool = False) -> None:
        self.name = name
        flags = mmap.MAP_SHARED | (mmap.MAP_POPULATE if populate else 0)
        if create:
            if size is None or size <= 0:
                raise ValueError(f"shm segment {name!r} needs a positive size, got {size!r}")
            try:
                shm = posix_ipc.SharedMemory("/" + name, posix_ipc.O_CREX, mode=0o600, size=size)
            except posix_ipc.ExistentialError:
                raise FileExistsError(
                    f"shm segment {name!r} exists already (left by a crashed run? fastkv-supervisor --cleanup)"
                ) from None
        else:
            try:
                shm = posix_ipc.SharedMemory("/" + name)
            except posix_ipc.ExistentialError:
                raise FileNotFoundError(f"shm segment {name!r} does not exist (not created yet?)") from None
            if size is not None and shm.size != size:
                actual = shm.size
                shm.close_fd()
                raise ValueError(f"shm segment {name!r} has {actual} bytes, expected {size}")
        try:
            self.size = shm.size
            if create and populate:
                _allocate(shm, name, size)
            self.buf = mmap.mmap(shm.fd, self.size, flags=flags)
        finally:
            shm.close_fd()

    def unlink(self) -> None:
        """Removes the name; mappings (here and in other processes) stay valid until dropped."""
        unlink_segment(self.name)

    def release(self, offset: int, length: int) -> None:
        """Give the pages of [offset, offset + length) back to the OS (MADV_REMOVE punches them
        out of the shm object): every process's mapping stays valid and reads zeros there, and
        the memory comes back page by page as it is written again."""
        assert offset % mmap.PAGESIZE == 0, f"release offset {offset} is not page-aligned"
        whole = length - length % mmap.PAGESIZE
        if whole > 0:
            self.buf.madvise(mmap.MADV_REMOVE, offset, whole)
        self.buf[offset + whole : offset + length] = bytes(length - whole)  # a partial last page stays: zero it


def _allocate(shm: posix_ipc.SharedMemory, name: str, size: int) -> None:
    """Allocates every page of a new segment now, as a GPU deployment pins its host memory up
    front: a tier too big for /dev/shm fails here, in one line, not with SIGBUS mid-run, and
    no copy pays the page faults of first touch (a first copy into fresh shm costs several
    times the next ones, and auto preemption would price every copy by it)."""
    try:
        os.posix_fallocate(shm.fd, 0, size)
    except OSError as e:
        unlink_segment(name)
        free = os.statvfs(SHM_DIR)
        raise MemoryError(f"shm segment {name!r}: cannot allocate {size / 2**20:.0f} MiB in {SHM_DIR} "
                          f"({free.f_bavail * free.f_frsize / 2**20:.0f} MiB free): {e.strerror}") from None


def resident_bytes(name: str) -> int:
    """Bytes of memory the shm object ``name`` holds now (its allocated pages, not its size)."""
    return os.stat(SHM_DIR / name).st_blocks * 512


def unlink_segment(name: str) -> bool:
    """Unlinks a segment by name; False when it was not there."""
    try:
        posix_ipc.unlink_shared_memory("/" + name)
    except posix_ipc.ExistentialError:
        return False
    return True


def _write_header(buf: mmap.mmap, kind: TierKind, num_blocks: int, payload: int, layout: KVLayout) -> None:
    describe = layout.describe().encode()
    assert len(describe) < 256, f"layout description too long for the tier header: {describe!r}"
    buf[8 : _HEADER.size] = _HEADER.pack(b"\0" * 8, kind, num_blocks, payload, describe)[8:]
    buf[0:8] = _MAGIC


def _read_header(buf: mmap.mmap, name: str, kinds: tuple[TierKind, ...], num_blocks: int, layout: KVLayout) -> tuple:
    magic, kind, blocks, payload, describe = _HEADER.unpack_from(buf, 0)
    if magic != _MAGIC:
        raise ValueError(f"shm segment {name!r} is not a complete fastkv tier (bad magic {magic!r})")
    if kind not in kinds:
        raise ValueError(f"shm segment {name!r} holds a tier of kind {kind}, expected one of {[int(k) for k in kinds]}")
    describe = describe.rstrip(b"\0").decode()
    if describe != layout.describe() or blocks != num_blocks:
        raise ValueError(
            f"shm segment {name!r} holds {blocks} blocks of layout {describe!r}; "
            f"attaching with {num_blocks} blocks of {layout.describe()!r}"
        )
    return TierKind(kind), payload


def numpy_to_paddle(array: np.ndarray, dtype: str) -> Any:
    """A Paddle CPU tensor over ``array``'s memory (zero-copy, checked). bfloat16 bytes come as uint16."""
    import paddle
    from paddle.utils.dlpack import from_dlpack

    if dtype == "bfloat16":
        if array.dtype != np.uint16:
            raise TypeError(f"bfloat16 bytes travel as uint16 arrays, got {array.dtype}")
        # Paddle reads DLPack uint16 as its own uint16 (few kernels); int16 reinterprets cleanly.
        tensor = from_dlpack(array.view(np.int16)).view(paddle.bfloat16)
    else:
        if array.dtype != np.dtype(dtype):
            raise TypeError(f"expected a {dtype} array, got {array.dtype}")
        tensor = from_dlpack(array)
    assert tensor.data_ptr() == array.ctypes.data, "DLPack made a copy of a shared tier array"
    return tensor


def paddle_to_numpy(tensor: Any) -> np.ndarray:
    """A numpy view of a Paddle CPU tensor (zero-copy; bfloat16 as uint16)."""
    import paddle

    if tensor.dtype == paddle.bfloat16:
        return np.from_dlpack(tensor.view(paddle.int16)).view(np.uint16)
    return np.from_dlpack(tensor)


@dataclass(slots=True)
class DeviceTier:
    """One rank's device tier: per layer, a K and a V tensor ``layout.device_shape(num_blocks)``
    (MLA: the latent in ``k``, and ``v`` empty). A sliding-window hybrid's KV cache groups may
    have blocks of their own (``layer_blocks``: per layer its count, ``KVLayout.layer_blocks``).

    ``k_arrays``/``v_arrays`` are numpy views of the same bytes on the shm backend (empty on CUDA).
    """

    layout: KVLayout
    num_blocks: int
    name: str
    kind: TierKind
    k: list[Any] = field(default_factory=list)
    v: list[Any] = field(default_factory=list)
    k_arrays: list[np.ndarray] = field(default_factory=list)
    v_arrays: list[np.ndarray] = field(default_factory=list)
    _segment: ShmSegment | None = None
    layer_blocks: tuple[int, ...] = ()  # per layer; () every layer ``num_blocks``

    def __post_init__(self) -> None:
        self.layer_blocks = tuple(self.layer_blocks) or (self.num_blocks,) * self.layout.num_layers

    @classmethod
    def create(
        cls, prefix: str, rank: int, layout: KVLayout, num_blocks: int, *, backend: str | None = None,
        populate: bool = False, layer_blocks: tuple[int, ...] = (),
    ) -> DeviceTier:
        """Allocates the tier (the worker of ``rank``). backend: "shm", "cuda" or None (CUDA if Paddle has it)."""
        _check_blocks(num_blocks)
        name = device_tier_name(prefix, rank)
        if backend is None:
            backend = "cuda" if _cuda_available() else "shm"
        if backend == "shm":
            payload = layout.kv_pages * sum(_per_layer(layout, num_blocks, layer_blocks)) * layout.page_bytes
            segment = ShmSegment(name, HEADER_BYTES + payload, create=True,
                                 populate=populate)
            try:
                tier = cls(layout, num_blocks, name, TierKind.DEVICE_SHM, _segment=segment, layer_blocks=layer_blocks)
                tier._map_shm()
            except BaseException:
                segment.unlink()
                raise
            _write_header(segment.buf, TierKind.DEVICE_SHM, num_blocks, payload, layout)
            return tier
        if backend == "cuda":
            return cls._create_cuda(name, layout, num_blocks, layer_blocks)
        raise ValueError(f"backend must be 'shm', 'cuda' or None, got {backend!r}")

    @classmethod
    def attach(cls, prefix: str, rank: int, layout: KVLayout, num_blocks: int, *, populate: bool = False,
               layer_blocks: tuple[int, ...] = ()) -> DeviceTier:
        """Maps the tier that rank's worker created (the transfer process)."""
        _check_blocks(num_blocks)
        name = device_tier_name(prefix, rank)
        segment = ShmSegment(name, create=False, populate=populate)
        kind, payload = _read_header(
            segment.buf, name, (TierKind.DEVICE_SHM, TierKind.DEVICE_CUDA_IPC), num_blocks, layout
        )
        tier = cls(layout, num_blocks, name, kind, _segment=segment, layer_blocks=layer_blocks)
        if kind is TierKind.DEVICE_SHM:
            expected = HEADER_BYTES + layout.kv_pages * sum(tier.layer_blocks) * layout.page_bytes
            if segment.size != expected:
                raise ValueError(f"shm segment {name!r} has {segment.size} bytes, expected {expected}")
            tier._map_shm()
        else:
            tier._open_cuda(json.loads(segment.buf[HEADER_BYTES : HEADER_BYTES + payload]))
        return tier

    def _map_shm(self) -> None:
        assert self._segment is not None, "shm device tier without a segment"
        views = []
        pages = self.layout.kv_pages
        offset = HEADER_BYTES
        for i in range(pages * self.layout.num_layers):
            blocks = self.layer_blocks[i // pages]
            layer_bytes = blocks * self.layout.page_bytes
            views.append(np.frombuffer(self._segment.buf, self.layout.numpy_dtype, layer_bytes // self.layout.itemsize,
                                       offset).reshape(self.layout.device_shape(blocks)))
            offset += layer_bytes
        self.k_arrays, self.v_arrays = _split_pages(views, pages)
        self.k = [numpy_to_paddle(a, self.layout.dtype) for a in self.k_arrays]
        self.v = [numpy_to_paddle(a, self.layout.dtype) for a in self.v_arrays]

    @classmethod
    def _create_cuda(cls, name: str, layout: KVLayout, num_blocks: int,
                     layer_blocks: tuple[int, ...] = ()) -> DeviceTier:
        import paddle

        pages = layout.kv_pages
        per_layer = _per_layer(layout, num_blocks, layer_blocks)
        tensors = [paddle.zeros(list(layout.device_shape(per_layer[i // pages])), dtype=layout.dtype)
                   for i in range(pages * layout.num_layers)]
        return cls._publish_cuda(name, layout, num_blocks, *_split_pages(tensors, pages), layer_blocks)

    @classmethod
    def _publish_cuda(cls, name: str, layout: KVLayout, num_blocks: int, k: list, v: list,
                      layer_blocks: tuple[int, ...] = ()) -> DeviceTier:
        """Writes the CUDA IPC handles of ``k``/``v`` (interleaved K[0], V[0], ...) under ``name``."""
        tensors = [t for pair in zip(k, v, strict=True) for t in pair] if v else list(k)
        metas = [t.value().get_tensor()._share_cuda() for t in tensors]
        if any(len(m) != 7 for m in metas):
            raise RuntimeError(
                "Paddle shares these tensors by virtual-memory handles, which cannot cross processes through "
                "shm: set FLAGS_use_virtual_memory_auto_growth=0 in the worker"
            )
        payload = json.dumps([_encode_meta(m) for m in metas]).encode()
        segment = ShmSegment(name, HEADER_BYTES + len(payload), create=True)
        segment.buf[HEADER_BYTES : HEADER_BYTES + len(payload)] = payload
        _write_header(segment.buf, TierKind.DEVICE_CUDA_IPC, num_blocks, len(payload), layout)
        return cls(layout, num_blocks, name, TierKind.DEVICE_CUDA_IPC, k=list(k), v=list(v), _segment=segment,
                   layer_blocks=layer_blocks)

    @classmethod
    def adopt(cls, prefix: str, rank: int, layout: KVLayout, k_caches: list, v_caches: list) -> DeviceTier:
        """The deployment's own per-layer K/V caches (each ``layout.device_shape(n)``) as rank
        ``rank``'s device tier, for a model runner that allocates them itself (FastDeploy's does).

        CUDA tensors are shared as they are (zero copy: their IPC handles go under the tier's
        name; the deployment keeps using its tensors, the transfer process attaches them).
        CPU memory cannot be shared with another process after it was allocated, so CPU caches
        (Paddle tensors or numpy arrays) move: their contents are copied into a new shm tier,
        and the deployment must use ``tier.k``/``tier.v`` (or the numpy views) from then on."""
        num_blocks = _check_caches(layout, k_caches, v_caches)
        name = device_tier_name(prefix, rank)
        if not isinstance(k_caches[0], np.ndarray) and not k_caches[0].place.is_cpu_place():
            return cls._publish_cuda(name, layout, num_blocks, list(k_caches), list(v_caches))
        arrays = [c if isinstance(c, np.ndarray) else paddle_to_numpy(c) for c in [*k_caches, *v_caches]]
        if any(a.dtype != layout.numpy_dtype for a in arrays):
            raise ValueError(f"caches of dtype {arrays[0].dtype} for a layout of {layout.dtype}")
        tier = cls.create(prefix, rank, layout, num_blocks, backend="shm")
        for dst, src in zip([*tier.k_arrays, *tier.v_arrays], arrays, strict=True):
            dst[...] = src
        return tier

    def _open_cuda(self, metas: list) -> None:
        import paddle

        pages = self.layout.kv_pages
        if len(metas) != pages * self.layout.num_layers:
            raise ValueError(f"{self.name!r} shares {len(metas)} tensors, expected {pages * self.layout.num_layers}")
        tensors = [paddle.to_tensor(paddle.base.core.DenseTensor._new_shared_cuda(_decode_meta(m))) for m in metas]
        self.k, self.v = _split_pages(tensors, pages)

    def unlink(self) -> None:
        """Removes the name (the creator, at shutdown); attached processes keep their mappings."""
        unlink_segment(self.name)

    def release(self) -> int:
        """Frees the memory of a shm tier's contents (a weight update with free_memory: they
        are dead) while every process keeps its mapping; written pages come back as zeros.
        Returns the bytes the segment held before. A CUDA tier is freed by dropping every
        reference to its tensors instead (``fastkv.engine.worker``)."""
        if self.kind is not TierKind.DEVICE_SHM or self._segment is None:
            raise ValueError(f"{self.name!r}: only a mapped shm device tier can be released in place")
        held = resident_bytes(self.name)
        self._segment.release(HEADER_BYTES, self._segment.size - HEADER_BYTES)
        return held

    def close(self) -> None:
        """Drops this process's tensors and views; the memory goes when the last reference does."""
        self.k, self.v, self.k_arrays, self.v_arrays = [], [], [], []
        self._segment = None


def block_checksum(block: np.ndarray) -> bytes:
    """A host block's checksum: xxh3-128 of the xxh3-64 digests of its pages (its [layers, 2]
    K and V pages in host order), 8 little-endian bytes each. Per page, so that a SWAP_OUT
    hashes each page in the same pass over its bytes as the copy
    (ops/block_digest.h, the kernel's version; this one is its reference)."""
    pages = np.ascontiguousarray(block).reshape(block.shape[0] * block.shape[1], -1)
    return xxhash.xxh3_128_digest(b"".join(xxhash.xxh3_64_intdigest(p).to_bytes(8, "little") for p in pages))


@dataclass(slots=True)
class HostTier:
    """One rank's host tier: ``array`` is ``layout.host_shape(num_blocks)`` over the shm segment."""

    layout: KVLayout
    num_blocks: int
    name: str
    array: np.ndarray
    checksums: np.ndarray  # uint8 [num_blocks, CHECKSUM_BYTES]
    _segment: ShmSegment | None = None
    _tensor: Any = None
    pinned: bool = False

    @classmethod
    def create(cls, prefix: str, rank: int, layout: KVLayout, num_blocks: int, *, populate: bool = False,
               group: int | None = None) -> HostTier:
        """Creates the segment (the supervisor; needs no Paddle). ``group``: a hybrid's KV cache
        group, whose layers alone ``layout`` describes (``KVLayout.group_layout``)."""
        _check_blocks(num_blocks)
        name = host_tier_name(prefix, rank, group)
        data = num_blocks * layout.block_bytes
        segment = ShmSegment(name, cls._size(layout, num_blocks), create=True, populate=populate)
        tier = cls(layout, num_blocks, name, *cls._views(segment, layout, num_blocks), segment)
        tier.seal_zeros()  # a new segment is zeros
        _write_header(segment.buf, TierKind.HOST, num_blocks, data, layout)
        return tier

    @classmethod
    def attach(
        cls, prefix: str, rank: int, layout: KVLayout, num_blocks: int, *, pin: bool | None = None,
        populate: bool = False, group: int | None = None,
    ) -> HostTier:
        """Maps the rank's host tier (the transfer process). pin: cudaHostRegister it (default: on
        CUDA builds). ``group``: as ``create``."""
        _check_blocks(num_blocks)
        name = host_tier_name(prefix, rank, group)
        segment = ShmSegment(name, cls._size(layout, num_blocks), create=False, populate=populate)
        _read_header(segment.buf, name, (TierKind.HOST,), num_blocks, layout)
        tier = cls(layout, num_blocks, name, *cls._views(segment, layout, num_blocks), segment)
        if pin is None:
            pin = _cuda_available()
        if pin:
            from fastkv.kernels import ops

            ops.pin_host(tier.tensor)  # the CUDA path DMAs from it and maps it into the gather kernel
            tier.pinned = True
        return tier

    @staticmethod
    def _size(layout: KVLayout, num_blocks: int) -> int:
        return HEADER_BYTES + num_blocks * (layout.block_bytes + CHECKSUM_BYTES)

    @staticmethod
    def _views(segment: ShmSegment, layout: KVLayout, num_blocks: int) -> tuple[np.ndarray, np.ndarray]:
        data = num_blocks * layout.block_bytes
        array = np.frombuffer(segment.buf, layout.numpy_dtype, data // layout.itemsize, HEADER_BYTES)
        sums = np.frombuffer(segment.buf, np.uint8, num_blocks * CHECKSUM_BYTES, HEADER_BYTES + data)
        return array.reshape(layout.host_shape(num_blocks)), sums.reshape(num_blocks, CHECKSUM_BYTES)

    def seal_zeros(self) -> None:
        """Seal every block as zeros at once, without touching the data pages."""
        self.checksums[:] = np.frombuffer(block_checksum(np.zeros_like(self.array[0])), np.uint8)

    def seal(self, blocks: Iterable[int]) -> None:
        """Record the checksum of each block's current bytes (it just landed here)."""
        blocks = list(blocks)
        if blocks:
            self.checksums[blocks] = self._checksums_of(blocks)

    def _checksums_of(self, blocks: list[int], hold_gil: bool = False) -> np.ndarray:
        """uint8 [len(blocks), 16]: by the ops kernel where this process loaded it (the transfer
        process: AVX2 xxh3, no Python per page; ``hold_gil`` as ``ops.c_abi``), else by the
        reference."""
        from fastkv.kernels import ops

        if ops.loaded():
            return ops.block_checksums(self.array, blocks, hold_gil)
        return np.array([np.frombuffer(block_checksum(self.array[b]), np.uint8) for b in blocks], np.uint8)

    def unseal(self, blocks: Iterable[int]) -> None:
        """Mark each block's bytes as not landed: zero its checksum, which a block's bytes
        match with probability 2**-128, so ``corrupt`` reports it until it is sealed again."""
        for b in blocks:
            self.checksums[b] = 0

    def corrupt(self, blocks: Iterable[int], hold_gil: bool = False) -> list[int]:
        """The blocks whose bytes no longer match the checksum ``seal`` recorded (``hold_gil``:
        as ``ops.c_abi``)."""
        blocks = list(blocks)
        for b in blocks:
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"host block {b} out of range [0, {self.num_blocks})")
        if not blocks:
            return []
        now = self._checksums_of(blocks, hold_gil)
        return [b for b, ok in zip(blocks, (now == self.checksums[blocks]).all(axis=1), strict=True) if not ok]

    @property
    def tensor(self) -> Any:
        """The tier as a Paddle CPU tensor over the same memory (created on first use)."""
        if self._tensor is None:
            self._tensor = numpy_to_paddle(self.array, self.layout.dtype)
        return self._tensor

    def block_bytes(self, block: int) -> memoryview:
        """The bytes of one host block (one contiguous span: what the storage tier writes)."""
        if not 0 <= block < self.num_blocks:
            raise ValueError(f"host block {block} out of range [0, {self.num_blocks})")
        return memoryview(self.array[block]).cast("B")

    def unlink(self) -> None:
        unlink_segment(self.name)

    def release(self) -> int:
        """Frees the memory of every block (their contents are dead: a weight update with
        free_memory) and seals them as the zeros they read from now on; the mapping stays.
        Pinned memory is unpinned first (the pages must be free to go) and pinned again
        when the tier is attached anew. Returns the bytes the segment held before."""
        if self._segment is None:
            raise ValueError(f"{self.name!r} is closed")
        if self.pinned:
            from fastkv.kernels import ops

            ops.pin_host(self.tensor, pin=False)
            self.pinned = False
        held = resident_bytes(self.name)
        self._segment.release(HEADER_BYTES, self.num_blocks * self.layout.block_bytes)
        self.seal_zeros()
        return held

    def close(self) -> None:
        """Unpins (if pinned here) and drops this process's views."""
        if self.pinned:
            from fastkv.kernels import ops

            ops.pin_host(self.tensor, pin=False)
            self.pinned = False
        self._tensor = None
        self.array = np.empty(0, self.layout.numpy_dtype)
        self.checksums = np.empty((0, CHECKSUM_BYTES), np.uint8)
        self._segment = None


def _split_pages(tensors: list, pages: int) -> tuple[list, list]:
    """Tensors in tier order (K[0], V[0], K[1], ...; MLA: the latents) -> (K, V); V empty for MLA."""
    return (tensors[0::2], tensors[1::2]) if pages == 2 else (list(tensors), [])


def _check_caches(layout: KVLayout, k_caches: list, v_caches: list) -> int:
    """How many blocks caches of ``layout``'s shape hold (ValueError naming the first cache that differs)."""
    v_want = layout.num_layers if layout.kv_pages == 2 else 0
    if len(k_caches) != layout.num_layers or len(v_caches) != v_want:
        what = "K and V caches" if v_want else "latent caches and no V"
        raise ValueError(f"need {layout.num_layers} {what} (one per layer), got {len(k_caches)} and "
                         f"{len(v_caches)}")
    num_blocks = int(k_caches[0].shape[0])
    _check_blocks(num_blocks)
    want = tuple(layout.device_shape(num_blocks))
    for i, cache in enumerate([*k_caches, *v_caches]):
        if tuple(cache.shape) != want:
            which = f"{'KV'[i // layout.num_layers]} cache of layer {i % layout.num_layers}"
            raise ValueError(f"{which} has shape {tuple(cache.shape)}, expected {want}")
    return num_blocks


def _per_layer(layout: KVLayout, num_blocks: int, layer_blocks: tuple[int, ...]) -> tuple[int, ...]:
    """Blocks of each layer's tensors: ``layer_blocks``, or ``num_blocks`` for every layer."""
    if not layer_blocks:
        return (num_blocks,) * layout.num_layers
    if len(layer_blocks) != layout.num_layers:
        raise ValueError(f"layer_blocks must name each of the {layout.num_layers} layers, got {len(layer_blocks)}")
    for n in layer_blocks:
        _check_blocks(n)
    return tuple(layer_blocks)


def _check_blocks(num_blocks: int) -> None:
    if not isinstance(num_blocks, int) or isinstance(num_blocks, bool) or num_blocks <= 0:
        raise ValueError(f"num_blocks must be a positive int, got {num_blocks!r}")


def _cuda_available() -> bool:
    try:
        import paddle
    except ImportError:
        return False
    return bool(paddle.is_compiled_with_cuda()) and paddle.device.cuda.device_count() > 0


def select_device(device_id: int) -> bool:
    """Make accelerator ``device_id`` (among the visible ones) this process's device, on a CUDA
    build; the worker and the transfer process of a rank both call it. Returns whether it did."""
    if not _cuda_available():
        return False
    import paddle

    count = paddle.device.cuda.device_count()
    if not 0 <= device_id < count:
        raise ValueError(f"device {device_id} is not one of the {count} visible GPUs (CUDA_VISIBLE_DEVICES)")
    paddle.set_device(f"gpu:{device_id}")
    return True


def _encode_meta(value: Any) -> Any:
    if isinstance(value, bytes):
        return {"bytes": value.hex()}
    if isinstance(value, list | tuple):
        return [_encode_meta(v) for v in value]
    return value


def _decode_meta(value: Any) -> Any:
    if isinstance(value, dict):
        return bytes.fromhex(value["bytes"])
    if isinstance(value, list):
        return tuple(_decode_meta(v) for v in value)
    return value

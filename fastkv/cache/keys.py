"""Chained block keys under a namespace fingerprint.

Three BLAKE3 domains (BLAKE3's derive-key contexts are separate domains from its plain hash)::

    namespace  = derive_key("fastkv 2025 namespace v1",  canonical(model id, weights version, KV dtype,
                                                                   layout, block size, tp size))
    root       = derive_key("fastkv 2025 root key v1",   namespace ‖ request extras)
    key(i)     = blake3(key(i-1) ‖ int32 token bytes of block i [‖ block extras])   key(-1) = root
    private    = derive_key("fastkv 2025 private key v1", namespace ‖ parent ‖ request id ‖ epoch ‖ tokens)
    resume     = derive_key("fastkv 2025 resume key v1",  namespace ‖ parent ‖ run ‖ request id ‖ computed tokens)

The namespace enters every key through the root of its chain: folding it there rather than
hashing it again in every block keeps a block's input at 288 bytes (4.5 BLAKE3 blocks) for
64-token blocks, and two chains with different roots never share a key. The tp *rank* is not
in the namespace: one prefix index serves every rank (they hold the same block ids); the
storage tier appends the rank to form each rank's shard key.

Request extras (LoRA adapter, tenant salt) change the root; multimodal item hashes are added
to the blocks whose token span they overlap. Every extra is tagged and length-prefixed, so
no two different extra sets encode to the same bytes, and a block with extras is longer than
one without.

Keys for a prompt come from one ``tobytes()`` of the int32 token array and one C call for the
whole chain (``fastkv.native._chain``, upstream BLAKE3's C code): no per-block Python work. Blocks with
extras go through the blake3 binding, one call per block (``block_keys_reference``).
"""
from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NewType

import numpy as np
from blake3 import blake3

from fastkv.config import KVLayout
from fastkv.native.compiled import load

_chain = load("_chain")

# Raw bytes stand for several kinds of key; these types tell them apart (NewType: no runtime cost).
BlockKey = NewType("BlockKey", bytes)  # chained key of a full block: every request with the prefix names it
PrivateKey = NewType("PrivateKey", bytes)  # an offloaded request's partial block: only it can name it
ResumeKey = NewType("ResumeKey", bytes)  # storage-mode preemption's partial block, scoped to this cache's run
TailKey = NewType("TailKey", bytes)  # a prefill handoff's partial block before the prompt's last token

KEY_BYTES = 32
_NS_CTX = "fastkv 2025 namespace v1"
_ROOT_CTX = "fastkv 2025 root key v1"
_PRIVATE_CTX = "fastkv 2025 private key v1"
_RESUME_CTX = "fastkv 2025 resume key v1"
_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _field(tag: bytes, value: bytes) -> bytes:
    return tag + struct.pack("<I", len(value)) + value


def _text(value: object) -> bytes:
    return value if isinstance(value, bytes) else str(value).encode()


@dataclass(frozen=True, slots=True)
class KeyNamespace:
    """Everything that changes the bytes of a block; ``fingerprint`` is its 32-byte digest."""

    model_id: str
    weights_version: str
    layout: str  # KVLayout.describe(): layers, heads, head_dim, dtype, tp size, block size
    kv_dtype: str
    block_size: int
    tp_size: int
    fingerprint: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"KeyNamespace.block_size must be a positive int, got {self.block_size!r}")
        if not isinstance(self.tp_size, int) or self.tp_size <= 0:
            raise ValueError(f"KeyNamespace.tp_size must be a positive int, got {self.tp_size!r}")
        data = b"".join(
            _field(tag, _text(value))
            for tag, value in (
                (b"M", self.model_id), (b"W", self.weights_version), (b"L", self.layout),
                (b"D", self.kv_dtype), (b"B", self.block_size), (b"T", self.tp_size),
            )
        )
        object.__setattr__(self, "fingerprint", blake3(data, derive_key_context=_NS_CTX).digest())

    @classmethod
    def for_layout(cls, model_id: str, weights_version: str, layout: KVLayout) -> KeyNamespace:
        return cls(model_id, str(weights_version), layout.describe(), layout.kv_cache_dtype, layout.block_size,
                   layout.tp_size)

    def with_weights(self, weights_version: str) -> KeyNamespace:
        return KeyNamespace(self.model_id, str(weights_version), self.layout, self.kv_dtype, self.block_size,
                         self.tp_size)


@dataclass(frozen=True, slots=True)
class ExtraKeys:
    """What besides the tokens decides a request's KV.

    ``mm`` lists multimodal items as ``(start_token, end_token, content_hash)``: every block
    whose tokens overlap ``[start, end)`` carries the item's hash in its key.
    """

    lora_id: str | int | None = None
    tenant_salt: bytes | str | None = None
    mm: tuple[tuple[int, int, bytes], ...] = ()

    def __post_init__(self) -> None:
        for item in self.mm:
            if (len(item) != 3 or not isinstance(item[0], int) or not isinstance(item[1], int)
                    or not 0 <= item[0] < item[1] or not isinstance(item[2], bytes)):
                raise ValueError(f"ExtraKeys.mm items must be (start, end, hash bytes) with 0 <= start < end: {item!r}")

    @classmethod
    def of(cls, cache_salt: str | bytes | None = None, lora: str | int | None = None,
           mm_items: Sequence = ()) -> ExtraKeys | None:
        """A request's extras from its public fields (``Engine.add_request``, the workload
        file, ``fastkv.routing.block_hashes``), None when it has none. ``cache_salt``: a
        tenant's secret (requests share KV only under the same salt); ``lora``: the adapter's
        id; ``mm_items``: multimodal items as ``(start, end, hash)`` or ``{"start", "end",
        "hash"}``, the hash as bytes or a hex string. ValueError naming the field."""
        if cache_salt is not None and (not isinstance(cache_salt, str | bytes) or not cache_salt):
            raise ValueError(f"cache_salt must be a non-empty string, got {cache_salt!r}")
        if lora is not None and (isinstance(lora, bool) or not isinstance(lora, str | int) or lora == ""):
            raise ValueError(f"lora must be an adapter id (a non-empty string or an int), got {lora!r}")
        items = []
        for item in mm_items or ():
            start, end, digest = ((item.get("start"), item.get("end"), item.get("hash"))
                                  if isinstance(item, dict) else tuple(item) if len(item) == 3 else (None,) * 3)
            if isinstance(digest, str):
                try:
                    digest = bytes.fromhex(digest)
                except ValueError:
                    digest = None
            if not (isinstance(start, int) and isinstance(end, int) and 0 <= start < end
                    and isinstance(digest, bytes) and digest):
                raise ValueError(f"mm_items: each item needs an int start < end >= 0 and a hash (bytes or hex), "
                                 f"got {item!r}")
            items.append((start, end, digest))
        if cache_salt is None and lora is None and not items:
            return None
        return cls(lora, cache_salt, tuple(items))  # the request's order: the key spec's (DESIGN.md)

    def root_bytes(self) -> bytes:
        out = b""
        if self.lora_id is not None:
            out += _field(b"lora", _text(self.lora_id))
        if self.tenant_salt is not None:
            out += _field(b"salt", _text(self.tenant_salt))
        return out

    def block_items(self, block_size: int) -> dict[int, tuple[bytes, ...]]:
        """The hashes of the multimodal items each block overlaps, in the request's order."""
        items: dict[int, tuple[bytes, ...]] = {}
        for start, end, digest in self.mm:
            for block in range(start // block_size, (end - 1) // block_size + 1):
                items[block] = items.get(block, ()) + (digest,)
        return items

    def block_extras(self, block_size: int) -> dict[int, bytes]:
        """Extra key bytes per block index, for the blocks a multimodal item overlaps."""
        extras: dict[int, bytes] = {}
        for start, end, digest in self.mm:
            for block in range(start // block_size, (end - 1) // block_size + 1):
                extras[block] = extras.get(block, b"") + _field(b"mm", struct.pack("<qq", start, end) + digest)
        return extras



def root_key(ns: KeyNamespace, extra: ExtraKeys | None = None) -> bytes:
    return root_of(ns.fingerprint, extra)


def root_of(fingerprint: bytes, extra: ExtraKeys | None = None) -> bytes:
    """The root of a chain from a namespace's fingerprint alone (what a router may know)."""
    data = fingerprint + (extra.root_bytes() if extra is not None else b"")
    return blake3(data, derive_key_context=_ROOT_CTX).digest()


def as_tokens(tokens: object, what: str = "tokens") -> np.ndarray:
    """A 1-D int32 array of token ids, or ValueError naming what is wrong."""
    arr = tokens if isinstance(tokens, np.ndarray) else np.asarray(tokens)
    if arr.ndim != 1:
        raise ValueError(f"{what} must be a 1-D array of token ids, got shape {arr.shape}")
    if arr.dtype.kind not in "iu":
        if arr.size == 0 and not isinstance(tokens, np.ndarray):
            return np.empty(0, np.int32)
        raise ValueError(f"{what} must hold integer token ids, got dtype {arr.dtype}")
    if arr.dtype != np.int32:
        if arr.size and (int(arr.min()) < _INT32_MIN or int(arr.max()) > _INT32_MAX):
            raise ValueError(f"{what}: token ids must fit in int32")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def block_keys(tokens: np.ndarray, block_size: int, parent: bytes, first: int = 0,
               extras: dict[int, bytes] | None = None) -> list[BlockKey]:
    """Keys of the full blocks of ``tokens`` from block index ``first`` on.

    ``tokens`` is the whole sequence (validated int32, see ``as_tokens``); ``parent`` is the
    key of block ``first - 1`` (the root when ``first`` is 0).
    """
    if extras:
        return block_keys_reference(tokens, block_size, parent, first, extras)
    data = tokens if tokens.flags.c_contiguous else tokens.tobytes()  # hashed in place: no copy
    return _chain.chain_keys(data, parent, block_size * 4, first, max(len(tokens) // block_size - first, 0))


def block_keys_reference(tokens: np.ndarray, block_size: int, parent: bytes, first: int = 0,
                         extras: dict[int, bytes] | None = None) -> list[bytes]:
    """``block_keys`` through the blake3 binding, one call per block: what defines the keys."""
    data = tokens.tobytes()
    step = block_size * 4
    stop = (len(tokens) // block_size) * step
    keys: list[bytes] = []
    append = keys.append
    key = parent
    for i, off in enumerate(range(first * step, stop, step), start=first):
        key = blake3(key + data[off:off + step] + (extras.get(i, b"") if extras else b"")).digest()
        append(key)
    return keys


def private_key(ns: KeyNamespace, parent: bytes, request_id: object, epoch: int,
                tokens: Sequence[int]) -> PrivateKey:
    """A key only its request can name: for the partial last block of a preempted request."""
    data = (ns.fingerprint + parent + _field(b"rid", _text(request_id)) + struct.pack("<q", epoch)
            + np.asarray(tokens, dtype=np.int32).tobytes())
    return blake3(data, derive_key_context=_PRIVATE_CTX).digest()


def resume_key(ns: KeyNamespace, parent: bytes, run: bytes, request_id: object, computed: bytes) -> ResumeKey:
    """The request-scoped storage key of a preempted request's partial last block: ``computed``
    is the int32 bytes of its tokens that hold KV, ``run`` a nonce of the cache that stored it.
    Engines number their requests from 0, so without ``run`` a restart or a second engine on
    the same store would derive the same key for its own request with that id."""
    data = ns.fingerprint + parent + _field(b"run", run) + _field(b"rid", _text(request_id)) + _field(b"tok", computed)
    return blake3(data, derive_key_context=_RESUME_CTX).digest()

"""The chained keys of a prompt's full blocks, as the engine computes them.

The engine's keys hang off a root derived from its namespace (model id, weights version, KV
layout, dtype, block size, tp size: fastkv.cache.keys.KeyNamespace). A router gets the
namespace from the same settings the engine runs with (``namespace_for``), or the engine's
32-byte fingerprint (``KeyNamespace.fingerprint``, in the run's summary as
``kv_events.namespace``), and calls ``block_hashes``: the same functions the cache calls
(``root_of``, ``block_keys``), so the keys are equal, not merely compatible.
"""
from __future__ import annotations

from fastkv.cache.keys import ExtraKeys, KeyNamespace, as_tokens, block_keys, root_of
from fastkv.config import KVLayout


def namespace_for(model_id: str, weights_version: str, layout: KVLayout) -> KeyNamespace:
    """The namespace of an engine run with these settings (``RunSpec``'s model id, weights
    version and layout)."""
    return KeyNamespace.for_layout(model_id, weights_version, layout)


def _root(namespace: KeyNamespace | bytes, extra: ExtraKeys | None) -> bytes:
    if isinstance(namespace, KeyNamespace):
        namespace = namespace.fingerprint
    if not isinstance(namespace, bytes) or len(namespace) != 32:
        raise ValueError("namespace must be a KeyNamespace or its 32-byte fingerprint")
    return root_of(namespace, extra)


def block_hashes(token_ids, namespace: KeyNamespace | bytes, block_size: int,
                 extra: ExtraKeys | None = None, *, cache_salt: str | bytes | None = None,
                 lora: str | int | None = None, mm_items=()) -> list[bytes]:
    """Keys of the full blocks of ``token_ids`` (any int sequence or array) under ``namespace``:
    element i is the key of tokens ``[i * block_size, (i + 1) * block_size)`` and of every
    block before it. A partial last block has no key (it is never shared). ``cache_salt``,
    ``lora`` and ``mm_items`` are the request's, as given to ``Engine.add_request`` (or
    ``extra``, their ``ExtraKeys``)."""
    if extra is None:
        extra = ExtraKeys.of(cache_salt, lora, mm_items)
    elif cache_salt is not None or lora is not None or mm_items:
        raise ValueError("give either extra or cache_salt / lora / mm_items, not both")
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(namespace, KeyNamespace) and namespace.block_size != block_size:
        raise ValueError(f"block_size {block_size} differs from the namespace's {namespace.block_size}")
    extras = extra.block_extras(block_size) or None if extra is not None else None
    return block_keys(as_tokens(token_ids), block_size, _root(namespace, extra), 0, extras)

"""Prefill -> decode handoff through the shared store, the cache's side.

A prefill engine hands a prompt to a decode engine through the storage tier. Everything
before the prompt's last token must be there: the decode engine computes that token in its
first step (``fastkv.sched.reservation``). The full blocks go under their chained prefix
keys, which the decode engine computes from the same tokens and namespace (so a decode
engine that has a prefix cached loads less); the partial block before the last token goes
under ``tail_key``, derived from the chain, the caller's request id and the tail tokens, so
only this handoff can name it.

``export`` copies what is missing from storage (device -> host -> storage, the write-through
path: host copies are keyed, then STOREd); ``exported`` says when all of it is stored; ``retry``
copies what found no host block then (copies in flight pin them all), or whose copy failed, from
the device blocks ``export`` holds until ``release``: every one of them, since a full block left
in the prefix cache can be evicted before its retry, and the
partial block has no key, so it would be freed with its request. Exports that share a prefix
share its holds (counted).
``CacheManager.allocate(tail_key=...)`` is the decode side's load.
"""
from __future__ import annotations

from collections.abc import Sequence

from fastkv.cache.copies import Purpose
from fastkv.cache.keys import BlockKey, TailKey, private_key
from fastkv.cache.plan import CopyPlan
from fastkv.cache.requests import ReqState
from fastkv.cache.state import CacheState
from fastkv.cache.tiering import host_copies, store


def tail_key(state: CacheState, keys: Sequence[BlockKey], root: bytes, handoff_id: str,
             tokens: Sequence[int]) -> TailKey | None:
    """The key of the partial block before the last of ``tokens`` (None: it has none).
    ``keys``/``root``: the prompt's chained keys and root, as ``CacheManager`` computes them."""
    bs = state.block_size
    full, tail = divmod(len(tokens) - 1, bs)
    if not tail:
        return None
    parent = keys[full - 1] if full else root
    return TailKey(private_key(state.namespace, parent, f"handoff/{handoff_id}", 0, tokens[full * bs:full * bs + tail]))


def export(state: CacheState, request_id: object, upto: int,
           tail: TailKey | None) -> tuple[list[bytes], list[CopyPlan]]:
    """Copy the KV of positions ``[0, upto)`` of a computed request to storage (its partial
    block under ``tail``); call it before the request is freed (the copies pin its device
    blocks). Returns the keys the decode side needs and the plans. Keys already stored, or on
    their way, are not copied again. The partial block goes first, and its device block is held
    for ``retry`` until ``release``."""
    req = state.get(request_id, ReqState.RUNNING)
    if req.num_computed < upto:
        raise ValueError(f"request {request_id!r}: export of {upto} tokens, {req.num_computed} computed")
    full, part = divmod(upto, state.block_size)
    pairs = list(zip(req.table[:full], req.keys[:full], strict=True))
    keys = [k for _, k in pairs]
    if part:
        assert tail is not None, f"request {request_id!r}: a partial block to export and no tail key"
        pairs.insert(0, (req.table[full], tail))
        keys.append(tail)
    for b, k in pairs:
        state.handoff_holds.hold(b, k)
    return keys, _copy(state, pairs)


def retry(state: CacheState, keys: Sequence[bytes]) -> list[CopyPlan]:
    """Copy again what of ``keys`` is neither stored nor moving but still cached on the device
    or the host (the export found no host block for it)."""
    moving, held = _moving(state), state.handoff_holds
    return _copy(state, [(held[k][0] if k in held else state.device.lookup.get(k), k)
                         for k in keys if k not in moving])


def release(state: CacheState, keys: Sequence[bytes]) -> None:
    """The export of ``keys`` is over (stored, or given up): let go of the blocks it held (a full
    one stays in the prefix cache, keyed as before)."""
    for k in keys:
        state.handoff_holds.release(k)


def _copy(state: CacheState, pairs: list[tuple[int | None, bytes]]) -> list[CopyPlan]:
    """STORE what is on the host, copy to the host (then STORE) what is only on the device
    (a block of None: on neither, nothing to copy)."""
    stored, hlookup = state.index.stored, state.host.lookup
    pairs = [(b, k) for b, k in pairs if k not in stored]
    on_host = [(hlookup[k], k) for _, k in pairs if k in hlookup]
    plans = store(state, [hb for hb, _ in on_host], [k for _, k in on_host]) if on_host else []
    return plans + host_copies(state, [(b, k) for b, k in pairs if b is not None and k not in hlookup])


def _moving(state: CacheState) -> set[bytes]:
    moving = set(state.copies.inflight)
    for rec in state.copies.records.values():
        if rec.purpose is Purpose.STORE:
            moving.update(rec.keys)
    return moving


def exported(state: CacheState, keys: Sequence[bytes]) -> bool | None:
    """True: storage holds every key; None: some are still on their way; False: not all, and
    nothing is moving (a copy failed or found no host block: ``retry`` may still have it)."""
    stored = state.index.stored
    missing = [k for k in keys if k not in stored]
    if not missing:
        return True
    moving = _moving(state)
    return None if any(k in moving for k in missing) else False

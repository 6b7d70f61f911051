"""Dropping the cached children a lost parent would strand.

Matching walks a chain from its root, so a key whose parent is in no tier can never be hit
again. Eviction never makes one (the pools evict leaves first), but a loss can: a failed or
skipped copy, a key a storage LOAD missed, a request freed without caching its blocks, a parent
a tier had to evict with children held or in flight. When a key leaves its last tier, its
CACHED children (and theirs, in turn) are dropped before the manager's operation returns
(``settles``) instead of holding blocks they can never serve, and so are the keys of blocks
only a copy pins and of held host blocks (FREE once let go: a chain hold, or an offloaded
request whose bytes stay valid under its block ids); a copy landing on the host keys a block
only if its parent is there to match it (``parent_present``). A device child a request holds
keeps its key: its table holds the chain's parents as well, and the release keys them again
(``release.release_table``) or drops them all. So "no cached key whose parent is in no tier"
holds whatever was lost.

Each pool names, per parent key, the blocks of its children (``BlockPool.children``), so the drop
costs what it drops: the common departure, a leaf's eviction, costs two dict probes.
"""
from __future__ import annotations

from collections.abc import Callable
from functools import wraps
from typing import TYPE_CHECKING, TypeVar

from fastkv.cache.index import Cause
from fastkv.cache.pool import BlockState
from fastkv.cache.write_policy import Tier

if TYPE_CHECKING:
    from fastkv.cache.state import CacheState

T = TypeVar("T")
_CACHED = int(BlockState.CACHED)


def present(state: CacheState, key: bytes) -> bool:
    """``key`` is in a tier, or a copy brings it to one."""
    return (key in state.device.lookup or key in state.host.lookup or key in state.index.stored
            or key in state.copies.inflight or key in state.copies.loading)


def parent_present(state: CacheState, key: bytes) -> bool:
    """``key`` hangs under nothing, or under a key that is ``present``."""
    pk = state.index.parents.get(key)
    return pk is None or present(state, pk)


def note_lost(state: CacheState, key: bytes) -> None:
    """``key`` just left its last tier: its children, if any, are dropped at the end of the
    manager's operation (``settles``), not now: the operation may hold their block ids."""
    if key in state.device.kids or key in state.host.kids:
        state.lose(key)


def settles(method: Callable[..., T]) -> Callable[..., T]:
    """A CacheManager operation that may take a key from its last tier: it drops the children
    that strands before it returns."""
    @wraps(method)
    def run(self, *args, **kwargs):
        out = method(self, *args, **kwargs)
        if self.state.lost:
            drop_stranded(self.state)
        return out
    return run


def drop_stranded(state: CacheState) -> None:
    """Drop the keys of the descendants, in every tier, of the keys ``note_lost`` listed that
    are still in no tier: CACHED blocks go FREE, pinned or held ones once let go. A device block
    a request holds keeps its key (its table holds the parents too). In the order the keys were
    lost, each one's children in the order they were keyed: the same run frees the same blocks."""
    dev, host = state.device, state.host
    lost = [k for k in dict.fromkeys(state.take_lost()) if not present(state, k)]
    while lost:
        dropped: list[tuple[bytes, Tier]] = []
        for pool, tier in ((dev, Tier.DEVICE), (host, Tier.HOST)):
            kids, pstate, ref, held_too = pool.kids, pool.state, pool.ref, pool is host
            for pk in lost:
                if pk not in kids:
                    continue
                for b in [b for b in pool.children(pk)
                          if b is not None and (held_too or pstate[b] == _CACHED or not ref[b])]:
                    dropped.append((pool.drop_key(b), tier))  # a held or pinned one: FREE once let go
        lost = []
        for k, tier in dropped:
            if not present(state, k):
                state.stats.dropped_keys += 1
                state.index.gone(k, tier, Cause.STRANDED)
                if k in dev.kids or k in host.kids:
                    lost.append(k)

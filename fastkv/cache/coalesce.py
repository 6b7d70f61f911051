"""Coalesced storage loads: one LOAD per key, however many admissions want it at once.

After a restart every request of the first admission wave misses the device and host, and
many share prefixes. Without this, each admission LOADs its own copy of a shared prefix into
its own host staging blocks: the storage tier serves the same bytes many times, the loads
queue behind each other in the transfer processes, and the copies never share a block.

Instead, an admission whose storage hit starts with keys another request's PREFIX_LOAD is
bringing (``CopyBook.loading``) joins that LOAD: it waits for it like for its own copies,
and when it lands takes a reference on the staged host blocks and swaps them in from there.
Only the keys nobody is loading are LOADed for it, up to the first one that is in flight
(past that, the chain would interleave two loads; the rest is recomputed, as without room).

Hit counting (CacheStats): a block is a storage hit only for the request whose LOAD brought
it; a request that joined is served from the host, where that LOAD landed, and counts a host
hit. So the storage hit ratio counts each stored block once per load, as the storage tier
served it, and a failed shared LOAD is a miss for every request that waited for it.
"""
from __future__ import annotations

from fastkv.cache.requests import CacheRecord
from fastkv.cache.state import CacheState


def split(state: CacheState, keys: list[bytes]) -> tuple[list[tuple[int, int]], list[bytes]]:
    """``keys`` (a storage hit, in chain order) as the leading run other LOADs bring, as
    (plan id, index in it), and the keys after it up to the next one in flight."""
    loading = state.copies.loading
    joins: list[tuple[int, int]] = []
    for k in keys:
        at = loading.get(k)
        if at is None:
            break
        joins.append(at)
    own = keys[len(joins):]
    for i, k in enumerate(own):
        if k in loading:
            return joins, own[:i]
    return joins, own


def join(state: CacheState, req: CacheRecord, joins: list[tuple[int, int]], first_slot: int) -> int:
    """``req`` waits for the LOADs in ``joins``; their blocks fill its load.swap_src from
    ``first_slot``. Returns how many plans it now waits for."""
    slots: dict[int, dict[int, int]] = {}
    for s, (pid, i) in enumerate(joins, first_slot):
        slots.setdefault(pid, {})[i] = s
    for pid, mine in slots.items():
        state.copies.join_load(pid, req, mine)
    state.stats.joined_load_blocks += len(joins)
    return len(slots)

"""Letting go of a request's blocks: device table last to first, then its host references."""
from __future__ import annotations

from fastkv.cache.index import Cause
from fastkv.cache.requests import CacheRecord
from fastkv.cache.state import CacheState
from fastkv.cache.tiering import release_chain
from fastkv.cache.write_policy import Tier


def release_table(state: CacheState, req: CacheRecord, cache: bool) -> None:
    """Release device blocks last to first, so children enter the eviction queue before parents,
    and the host copies of the chain the request held (``tiering.release_chain``)."""
    host_done = release_chain(state, req, touch=cache)  # its walk refreshed the host copies too
    dev = state.device
    if cache and not req.dup_pos and (host_done or not state.touch_host):
        dev.release_many(req.table[::-1])
        req.table = []
        return
    dkey, lookup, release, touch = dev.key, dev.lookup, dev.release, dev.touch
    keys, table, nk = req.keys, req.table, req.num_keyed
    hlookup = state.host.lookup if state.touch_host and not host_done else None
    for i in range(len(table) - 1, -1, -1):
        b = table[i]
        if i < nk and cache:
            k = keys[i]
            if dkey[b] is None:  # a duplicate: refresh the block that holds the key
                c = lookup.get(k)
                if c is None:  # that block is gone: this copy keeps the key alive
                    state.index.learn_at(keys, [i])
                    dev.set_key(b, k)
                release(b)
                if c is not None:
                    touch(c)
            else:
                release(b)
            if hlookup is not None:
                hb = hlookup.get(k)
                if hb is not None:
                    state.host.touch(hb)
        else:
            k = dkey[b] if not cache and dev.ref[b] == 1 else None
            release(b, cache)
            if k is not None:  # once it left the device: the children it strands go too
                state.gone_if_last(k, Tier.DEVICE, Cause.DROPPED, skip=Tier.DEVICE)
    req.table = []


def release_host_refs(state: CacheState, req: CacheRecord, cache: bool = True) -> None:
    host = state.host
    for b in reversed(req.host_refs):
        k = host.key[b] if not cache and b != req.resume.private_block else None
        host.release(b, cache and b != req.resume.private_block)
        if k is not None and k not in host.lookup:
            state.gone_if_last(k, Tier.HOST, Cause.DROPPED, skip=Tier.HOST)
    req.host_refs = []
    req.resume.let_go_block()

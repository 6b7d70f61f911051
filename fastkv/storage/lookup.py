"""One rank's answer to a LOOKUP task: how much of each key chain its storage shard holds.

A LOOKUP carries the keys of several requests' prompts (an admission wave), concatenated;
``lengths[i]`` says how many keys chain ``i`` has. Each chain is one prompt's blocks past
its device and host match, in order, so only a run of present keys from the chain's start
is usable: a hole means every later block is recomputed anyway. The rank answers, per
chain, the length of that run, from one ``exists`` batch (one transaction or one pipelined
round trip) that names each key once, however many chains of the wave share it. ``exists``
does not verify: the LOAD that follows does, and a value that
vanished or fails its checksum by then is a miss that the request recomputes.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fastkv.storage.base import StorageBackend


def found_prefixes(store: StorageBackend, keys: Sequence[bytes], lengths: np.ndarray) -> np.ndarray:
    """Per chain, how many of its leading keys ``store`` holds (int32, one per chain)."""
    unique = list(dict.fromkeys(keys))  # chains of one wave share prefixes: ask once per key
    held = dict(zip(unique, store.exists(unique), strict=True)) if unique else {}
    present = [held[k] for k in keys]
    out = np.zeros(len(lengths), np.int32)
    start = 0
    for i, n in enumerate(lengths.tolist()):
        run = 0
        while run < n and present[start + run]:
            run += 1
        out[i] = run
        start += n
    return out


def confirmed(per_rank: Sequence[np.ndarray], chains: int) -> np.ndarray:
    """The prefix every rank holds, per chain: a block missing on one rank is missing."""
    if not per_rank:
        return np.zeros(chains, np.int32)
    return np.minimum.reduce([np.asarray(f, np.int32) for f in per_rank])

"""Write policies: when a device block gets a copy in the host tier.

=========================  ===============================  ======================================
policy                     host copy made                   host tier is
=========================  ===============================  ======================================
WRITE_THROUGH              when the block is full and        inclusive: most device blocks also
                           inserted (after compute)          have a host copy; device eviction
                                                             drops the device copy (writes it
                                                             back if the host evicted its copy)
WRITE_THROUGH_SELECTIVE    once the block has been hit       inclusive for hot blocks only: saves
                           ``selective_hits`` times          copy bandwidth on one-off prompts
WRITE_BACK                 when the device evicts it         exclusive: a victim cache; a block
                                                             swapped back in leaves the host, so
                                                             device D + host H hold D + H blocks
=========================  ===============================  ======================================

Copies never run synchronously: a write-back victim's block is handed to the request that
evicted it only once its SWAP_OUT completes (that request waits, like one loading a prefix).
"""
from __future__ import annotations

from enum import IntEnum


class WritePolicy(IntEnum):
    WRITE_THROUGH = 1
    WRITE_THROUGH_SELECTIVE = 2
    WRITE_BACK = 3

    @property
    def copies_on_insert(self) -> bool:
        return self is WritePolicy.WRITE_THROUGH

    @property
    def copies_on_hit(self) -> bool:
        return self is WritePolicy.WRITE_THROUGH_SELECTIVE

    @property
    def copies_on_evict(self) -> bool:
        return self is WritePolicy.WRITE_BACK

    @property
    def host_inclusive(self) -> bool:
        """Host copies stay when their block is swapped in (else the host is exclusive)."""
        return self is not WritePolicy.WRITE_BACK


class StorageWrites(IntEnum):
    """Which host blocks are STOREd to the storage tier (fastkv.cache.storage_writes)."""

    PREEMPTED = 1
    THROUGH = 2
    BACK = 3


class Tier(IntEnum):
    DEVICE = 0
    HOST = 1
    STORAGE = 2

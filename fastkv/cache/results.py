"""What CacheManager's calls return to the scheduler."""
from __future__ import annotations

from typing import NamedTuple

from fastkv.cache.plan import CopyPlan


class Allocation(NamedTuple):
    block_table: tuple[int, ...]
    num_cached_tokens: int  # valid on the device now (device prefix hit)
    num_pending_tokens: int  # arriving by copies (host / storage hit); valid once ready
    plans: tuple[CopyPlan, ...]
    ready: bool  # False: wait for Completion.ready before running a step


class Growth(NamedTuple):
    new_blocks: tuple[int, ...]
    plans: tuple[CopyPlan, ...]  # write-back of evicted blocks
    ready: bool


class Ready(NamedTuple):
    request_id: object
    num_computed_tokens: int  # tokens whose KV is valid: compute from here (a failed copy lowers it)


class Completion(NamedTuple):
    plans: tuple[CopyPlan, ...] = ()  # follow-ups to dispatch now
    ready: tuple[Ready, ...] = ()
    offloaded: tuple[object, ...] = ()  # offload finished: device blocks released
    offload_failed: tuple[object, ...] = ()  # offload failed: still RUNNING on its device blocks


class PreemptionWork(NamedTuple):
    copy_blocks: int  # blocks an offload would copy out (and back in)
    recompute_tokens: int  # tokens a recompute would compute again, if its host copies last
    # Tokens a recompute counts on finding in host copies that it does not hold: an offload pins
    # them until the restore; after a recompute they are only cached, and evicted as any other.
    unheld_tokens: int

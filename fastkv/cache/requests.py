"""The cache manager's record of one request: its tokens as keys, its blocks, its copies."""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

NEVER = 1 << 62  # fail_block when no block failed


class ReqState(IntEnum):
    """Cache-side state. RUNNING requests may still wait for copies (``pending``)."""

    RUNNING = 1  # device blocks; ready to step when nothing is pending
    OFFLOADING = 2  # its blocks are being copied to the host
    OFFLOADED = 3  # host blocks only; restore() brings it back


@dataclass(slots=True, eq=False)
class CacheRecord:
    rid: object
    root: bytes  # key of the chain's root (namespace + request extras)
    extras: dict[int, bytes] | None  # per-block extra key bytes (multimodal items)
    keys: list[bytes]  # chained keys of every full block of the known tokens
    tail: list[int]  # known tokens after the last full block
    num_tokens: int  # known tokens (prompt + appended): slots are allocated for all of them
    table: list[int] = field(default_factory=list)  # device block ids
    host_refs: list[int] = field(default_factory=list)  # host blocks this request holds a reference on
    # write-through: host copies of its chain it holds while it holds its device table (tiering.hold_chain);
    # None before its first write-through and once it let go
    host_chain: list[int] | None = None
    chain_upto: int = 0  # leading chain keys that hold has covered
    chain_gen: int = 0  # holds let go of so far (an awaited parent names the hold it joins)
    wt_plans: list[int] = field(default_factory=list)  # ids of its write-throughs in flight
    num_computed: int = 0  # tokens whose KV is valid on the device
    num_keyed: int = 0  # leading blocks whose keys were inserted (a duplicate stays unkeyed)
    dup_pos: list[int] = field(default_factory=list)  # keyed positions left unkeyed: another block held the key
    loading: bool = False  # copies will bring tokens up to target_computed
    restoring: bool = False  # loading a restore: its host copies still hold all its computed KV
    target_computed: int = 0
    swap_src: list[int] = field(default_factory=list)  # host blocks waiting to be swapped in
    swap_pos: list[int] = field(default_factory=list)  # their positions in the table
    planned_hits: tuple[int, int] = (0, 0)  # host and storage hit blocks of its load, counted once it lands
    fail_block: int = NEVER  # first block whose copy failed (recompute from there)
    pending: int = 0  # plans this request waits for
    reserved: int = 0  # device blocks reserved for growth
    private_block: int = -1  # host block holding the partial last block under a private key
    last_block: list[int] | None = None  # tokens of the last full block (a resume key may need them)
    private_key: bytes | None = None  # in storage mode: its resume key (keys.resume_key)
    to_storage: bool = False  # preempted in storage mode: its blocks are STOREd when its offload lands
    state: ReqState = ReqState.RUNNING
    alive: bool = True  # False once freed: late completions must not touch it

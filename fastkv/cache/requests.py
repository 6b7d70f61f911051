"""The cache manager's record of one request: its tokens as keys, its blocks, its copies.

A ``CacheRecord`` is a small core (id, keys, tokens, device table, state) with three
sub-records, one per lifecycle, each changed only through its own methods:

* ``LoadProgress``: the copies bringing its KV onto the device (a prefix hit, a restore);
  present only while they fly (``CacheRecord.load is None`` otherwise);
* ``ChainHold``: the host copies of its chain a running request holds under write-through;
* ``Resume``: what a preempted request needs to come back (its partial block's host copy
  and key, its last full block's tokens).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

from fastkv.cache.keys import BlockKey, ExtraKeys


class ReqState(IntEnum):
    """Cache-side state. RUNNING requests may still wait for copies (``pending``)."""

    RUNNING = 1  # device blocks; ready to step when nothing is pending
    OFFLOADING = 2  # its blocks are being copied to the host
    OFFLOADED = 3  # host blocks only; restore() brings it back
    FREED = 4  # let go of (CacheManager.free): late completions must not touch it


@dataclass(slots=True, eq=False)
class LoadProgress:
    """Copies bringing a request's KV onto the device: a prefix hit's loads and swap-in, or a
    restore's swap-in. Its tokens are valid up to ``target_computed`` once they land, or up to
    the first block whose copy failed."""

    target_computed: int
    swap_src: list[int | None]  # host block per slot to swap in; None: its LOAD has not landed
    swap_pos: list[int]  # the slots' positions in the device table
    restoring: bool = False  # a restore: its host copies still hold all its computed KV
    planned_hits: tuple[int, int] = (0, 0)  # host and storage hit blocks, counted once they land
    fail_block: int | None = None  # first block whose copy failed (recompute from there)

    def failed_at(self, position: int) -> None:
        if self.fail_block is None or position < self.fail_block:
            self.fail_block = position

    def landed(self, slot: int, host_block: int) -> None:
        self.swap_src[slot] = host_block

    def swappable(self) -> bool:
        """Its first slot's host block is there: a swap-in can start."""
        return bool(self.swap_src) and self.swap_src[0] is not None

    def take_swap(self) -> tuple[list[int], list[int]]:
        """The leading slots whose host blocks are there, as (host blocks, table positions); every
        slot is let go of (a later one whose load failed is recomputed)."""
        src = self.swap_src
        for i, b in enumerate(src):
            if b is None:
                src = src[:i]
                break
        pos = self.swap_pos[:len(src)]
        self.drop_swap()
        return src, pos

    def drop_swap(self) -> None:
        self.swap_src = []
        self.swap_pos = []

    def valid_tokens(self, block_size: int) -> int:
        if self.fail_block is None:
            return self.target_computed
        return min(self.target_computed, self.fail_block * block_size)


@dataclass(slots=True, eq=False)
class ChainHold:
    """Write-through: the host copies of its chain a running request holds while it holds its
    device table (tiering.hold_chain), and its write-throughs in flight that join the hold."""

    blocks: list[int] | None = None  # None before its first write-through and once it let go
    upto: int = 0  # leading chain keys the hold has covered
    gen: int = 0  # holds let go of so far (an awaited parent names the hold it joins)
    plans: list[int] = field(default_factory=list)  # ids of its write-throughs in flight

    @property
    def held(self) -> bool:
        return self.blocks is not None

    def extend(self, blocks: list[int], upto: int) -> bool:
        """Hold ``blocks`` too, covering the chain's first ``upto`` keys; True: a new hold."""
        new = self.blocks is None
        if new:
            self.blocks = blocks
        else:
            self.blocks += blocks
        self.upto = upto
        return new

    def join(self, host_block: int) -> None:
        self.blocks.append(host_block)

    def own(self, plan_id: int) -> None:
        self.plans.append(plan_id)

    def landed(self, plan_id: int) -> None:
        self.plans.remove(plan_id)

    def let_go(self) -> tuple[list[int], list[int]]:
        """End the hold: returns its host blocks and the write-throughs still in flight."""
        blocks, plans = self.blocks, self.plans
        self.blocks, self.plans, self.upto = None, [], 0
        self.gen += 1  # its entries in CopyBook.awaited are void
        return blocks, plans


@dataclass(slots=True, eq=False)
class Resume:
    """What a preempted request needs to resume: its partial last block's host copy under a
    private key, its resume key in storage mode, and the tokens a resume key is made from."""

    last_block: list[int] | None = None  # tokens of the last full block (a resume key may need them)
    private_block: int | None = None  # host block holding the partial last block under a private key
    private_key: bytes | None = None  # its partial block's key: private, or in storage mode its resume key
    to_storage: bool = False  # preempted in storage mode: its blocks are STOREd when its offload lands

    def saw_block(self, tokens: list[int]) -> None:
        self.last_block = tokens

    def begin_offload(self, to_storage: bool) -> None:
        self.private_key = None
        self.to_storage = to_storage

    def keyed(self, key: bytes, host_block: int | None = None) -> None:
        """Its partial block goes to the host under ``key`` (in ``host_block`` when the key is
        private: nothing else may match that block, so it is let go of uncached)."""
        self.private_key = key
        if host_block is not None:
            self.private_block = host_block

    def resumed_on(self, host_block: int | None) -> None:
        self.private_block = host_block

    def let_go_block(self) -> None:
        self.private_block = None


@dataclass(slots=True, eq=False)
class CacheRecord:
    FIXED = ("rid", "root", "extras", "chain", "resume", "writes", "extra")  # set at construction, never rebound

    rid: object
    root: bytes  # key of the chain's root (namespace + request extras)
    extras: dict[int, bytes] | None  # per-block extra key bytes (multimodal items)
    keys: list[BlockKey]  # chained keys of every full block of the known tokens
    tail: list[int]  # known tokens after the last full block
    num_tokens: int  # known tokens (prompt + appended): slots are allocated for all of them
    table: list[int] = field(default_factory=list)  # device block ids
    host_refs: list[int] = field(default_factory=list)  # host blocks this request holds a reference on
    num_computed: int = 0  # tokens whose KV is valid on the device
    num_keyed: int = 0  # leading blocks whose keys were inserted (a duplicate stays unkeyed)
    dup_pos: list[int] = field(default_factory=list)  # keyed positions left unkeyed: another block held the key
    pending: int = 0  # plans this request waits for
    reserved: int = 0  # device blocks reserved for growth (state.Reservations changes it)
    state: ReqState = ReqState.RUNNING
    load: LoadProgress | None = None  # copies will bring tokens up to load.target_computed
    chain: ChainHold = field(default_factory=ChainHold)
    resume: Resume = field(default_factory=Resume)
    writes: bool = True  # its cache policy lets it write: its blocks are keyed, copied and cached
    extra: ExtraKeys | None = None  # what besides its tokens keys it (the adapter and items its events name)

    @property
    def alive(self) -> bool:
        """False once freed: late completions must not touch it."""
        return self.state is not ReqState.FREED

    @property
    def restoring(self) -> bool:
        """Loading a restore: its host copies still hold all its computed KV."""
        load = self.load
        return load is not None and load.restoring

"""CacheManager: the one type the scheduler talks to about KV blocks.

The manager owns the device and host block pools, the prefix index across tiers and every
request's block table. It performs no copies: calls that need bytes moved return
``CopyPlan``s (their blocks already IN_FLIGHT); the transfer layer executes them and the
scheduler reports each outcome with ``complete(plan, ok)``, which may return follow-up plans
and tells which requests became ready.

Life of a request, as the scheduler sees it::

    allocate(rid, prompt)        -> Allocation | None   (None: not enough blocks now)
        .ready False: wait for Completion.ready (prefix copies, write-back of evicted blocks)
    mark_computed(rid, n)        -> plans              (after a step: full blocks become cached)
    append_slots(rid, tokens)    -> Growth | None      (decode: one more token, maybe a block)
    offload(rid) / restore(rid)                        (preemption without recompute)
    free(rid, cache=True)                              (finished: full blocks stay cached)

A request may run a step only while it is ready (no copies of its own pending). Three error
tiers: "not now" is None, a broken contract is ValueError, an internal bug is an assert.

The manager is the facade over ``CacheState`` (state.py), which the role modules take:
tiering.py (fresh blocks, evictions, the plans that move keyed blocks), release.py (letting go
of a request's blocks), offload.py (offload / restore), completions.py (what a finished copy
changes), integrity.py (check_integrity). What its calls return is in plan.py.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import numpy as np

from fastkv.cache import handoff
from fastkv.cache.completions import finish
from fastkv.cache.copies import Purpose
from fastkv.cache.copies import join as join_loads
from fastkv.cache.copies import split as split_loads
from fastkv.cache.index import Cause, MatchResult, MissExplanation, MissReason
from fastkv.cache.integrity import check
from fastkv.cache.keys import BlockKey, ExtraKeys, KeyNamespace, ResumeKey, TailKey, as_tokens, block_keys, root_key
from fastkv.cache.offload import offload as offload_request
from fastkv.cache.offload import partial_resume_key, preemption_work
from fastkv.cache.offload import restore as restore_request
from fastkv.cache.plan import Allocation, ClearTask, Completion, CopyKind, CopyPlan, Growth, PreemptionWork, RestoreTask
from fastkv.cache.pool import BlockState
from fastkv.cache.release import release_host_refs, release_table
from fastkv.cache.request_policy import CachePolicy
from fastkv.cache.requests import CacheRecord, LoadProgress, ReqState
from fastkv.cache.residency import ResidencyLog, watch
from fastkv.cache.state import CacheConfig, CacheState
from fastkv.cache.storage_writes import deferred
from fastkv.cache.strands import note_lost, settles
from fastkv.cache.tiering import (
    count_hits,
    make_host_room,
    request_copies,
    retry_skipped,
    swap_in,
    take_device,
    take_host,
)
from fastkv.cache.write_policy import Tier
from fastkv.config import cdiv

_CACHED = int(BlockState.CACHED)
_HELD = (BlockState.ALLOCATED, BlockState.IN_FLIGHT)


def _readable(policy: CachePolicy | None, dev: list, host: list, sto: list) -> tuple[list, list, list]:
    """A prefix match cut at the first tier ``policy`` may not read."""
    if policy is None:
        return dev, host, sto
    n = len(policy.readable)
    return (dev if n > 0 else []), (host if n > 1 else []), (sto if n > 2 else [])


WAITING_KEYS = 1024  # requests whose keys allocate keeps while they wait (an aborted one ages out)


class CacheManager:
    def __init__(self, config: CacheConfig) -> None:
        self.state = state = CacheState(config)
        # the parts of the state callers read directly (the same objects, never rebound)
        self.config, self.block_size, self.policy = state.config, state.block_size, state.policy
        self.device, self.host, self.index, self.copies = state.device, state.host, state.index, state.copies
        self.stats = state.stats
        self._reqs = state.reqs  # read only: CacheState.admit / let_go change it
        # request id -> (root, extras, token bytes, keys): a waiting request's keys, hashed once
        self._waiting_keys: OrderedDict[object, tuple[bytes, dict[int, bytes] | None, bytes, list[bytes]]] = \
            OrderedDict()

    @property
    def namespace(self) -> KeyNamespace:
        """The key namespace of the current weights."""
        return self.state.namespace

    # ================================================================== queries
    def _chain(self, extra: ExtraKeys | None) -> tuple[bytes, dict[int, bytes] | None]:
        if extra is None:
            return self.state.root, None
        if not isinstance(extra, ExtraKeys):
            raise TypeError(f"extra must be an ExtraKeys, got {type(extra).__name__}")
        return root_key(self.namespace, extra), (extra.block_extras(self.block_size) or None)

    def keys_for(self, tokens: object, extra: ExtraKeys | None = None) -> list[BlockKey]:
        """Chained keys of the full blocks of ``tokens`` under the current namespace."""
        root, extras = self._chain(extra)
        toks = as_tokens(tokens)
        keys = block_keys(toks, self.block_size, root, 0, extras)
        if self.state.residency is not None:
            self.state.residency.register(keys, toks.tobytes(), self.block_size, extra=extra)
        return keys

    def _keys_of_waiting(self, request_id: object, toks: np.ndarray, root: bytes,
                         extras: dict[int, bytes] | None) -> list[bytes]:
        """Keys of the full blocks of a request being admitted. Admission retries the head of
        the queue every step until the device has room, and hashing its whole context each time
        would dominate those retries. Kept per request while it waits (the most recent
        WAITING_KEYS)."""
        data = toks.tobytes()
        memo = self._waiting_keys.get(request_id)
        if memo is not None and memo[0] == root and memo[1] == extras and memo[2] == data:
            self._waiting_keys.move_to_end(request_id)
            return list(memo[3])
        keys = block_keys(toks, self.block_size, root, 0, extras)
        self._waiting_keys[request_id] = (root, extras, data, keys)
        self._waiting_keys.move_to_end(request_id)
        while len(self._waiting_keys) > WAITING_KEYS:
            self._waiting_keys.popitem(last=False)
        return list(keys)

    def confirm_stored(self, keys: list[bytes]) -> None:
        """The storage tier holds ``keys`` (a lookup found them, maybe another engine's writes):
        ``allocate`` plans LOADs for them, and a LOAD that misses drops them again."""
        if self.index.storage:
            for k in keys:
                self.index.remember_stored(k)

    def match(self, tokens: object, extra: ExtraKeys | None = None, policy: CachePolicy | None = None) -> MatchResult:
        """The longest cached prefix of ``tokens`` (read-only: touches nothing, counts nothing)
        in the tiers ``policy`` may read.

        At least the last token is left out of a hit: a step needs one token to compute."""
        toks = as_tokens(tokens)
        root, extras = self._chain(extra)
        keys = block_keys(toks, self.block_size, root, 0, extras)
        dev, host, sto = _readable(policy, *self.index.match(keys, (len(toks) - 1) // self.block_size))
        return MatchResult(tuple(dev), tuple(host), tuple(sto), self.block_size, len(toks))

    def num_held_hits(self, match: MatchResult) -> int:
        """Device hits of ``match`` that other requests hold: the only ones an allocation does not
        take from ``num_free_device_blocks`` (a cached hit is counted there, and taken)."""
        dstate = self.device.state
        return sum(1 for b in match.device_blocks if dstate[b] != _CACHED)

    def skipped_stores(self) -> dict[str, int]:
        """Blocks a write policy wanted stored that the pool lacks, by reason (``store_backlog``):
        those lost, and those deferred and still waiting (lost if the run ended now)."""
        by = self.state.stats.skipped_by()
        for reason, n in self.state.deferred_stores.count().items():
            by[reason] += n
        return by

    def queued_blocks(self) -> tuple[int, int]:
        """Blocks of the SWAP_INs and of the LOADs in flight: the host and storage links' queues."""
        return self.state.copies.swaps_in_flight, len(self.state.copies.loading)

    @property
    def num_free_device_blocks(self) -> int:
        """Device blocks allocatable now: free + evictable, minus reservations."""
        return self.device.num_available - self.state.reservations.total

    @property
    def has_host_tier(self) -> bool:
        """Whether there are host blocks to offload to."""
        return self.host.capacity > 0

    @property
    def host_occupancy(self) -> float:
        """The share of the host tier that is not free (held, in flight or cached): how likely a
        cached host copy is to be evicted before it is needed again (0 without a host tier)."""
        cap = self.host.capacity
        return 1.0 - self.host.num_free / cap if cap else 0.0

    @property
    def num_export_holds(self) -> int:
        """Device blocks prefill exports hold until they are stored (``fastkv.cache.handoff``)."""
        return len(self.state.handoff_holds)

    def copies_in_flight(self) -> set[int]:
        """Ids of the plans handed out and not yet completed."""
        return set(self.copies.records)

    def has_copies_in_flight(self) -> bool:
        return bool(self.copies.records)

    def _get(self, request_id: object, *states: ReqState) -> CacheRecord:
        return self.state.get(request_id, *states)

    def request_ids(self) -> list[object]:
        """Ids of every request the manager holds blocks for, on any tier."""
        return list(self._reqs)

    def block_table(self, request_id: object) -> np.ndarray:
        return np.asarray(self.state.get(request_id).table, dtype=np.int32)

    @property
    def takes_blocks_per_step(self) -> bool:
        """False: ``append_slots`` takes every slotted token's blocks (``group_manager``'s are
        taken per step, by ``step_table``)."""
        return False

    def group_summary(self) -> list[dict[str, int]]:
        """Per KV cache group its counts (``group_manager``); none here: one group, the device's."""
        return []

    def step_table(self, request_id: object, start: int, count: int) -> np.ndarray:
        """The table a step computing [start, start + count) reads: the whole table, every block
        of every slotted token taken already (``fastkv.cache.group_manager`` takes them per step)."""
        return self.block_table(request_id)

    def request_state(self, request_id: object) -> ReqState:
        return self.state.get(request_id).state

    def is_ready(self, request_id: object) -> bool:
        req = self.state.get(request_id)
        return req.state is ReqState.RUNNING and req.pending == 0

    def is_restoring(self, request_id: object) -> bool:
        """Its restore's copies are in flight: ``offload`` returns it to OFFLOADED with no copy."""
        return self.state.get(request_id).restoring

    def num_computed_tokens(self, request_id: object) -> int:
        return self.state.get(request_id).num_computed

    # ================================================================== admission
    @settles
    def allocate(self, request_id: object, tokens: object, extra: ExtraKeys | None = None,
                 reserve_tokens: int = 0, tail_key: TailKey | None = None,
                 policy: CachePolicy | None = None,
                 hits: Callable[[int, int, int], tuple[int, int]] | None = None) -> Allocation | None:
        """Blocks for a prompt, reusing its longest cached prefix. None when the device lacks room.

        ``reserve_tokens`` also reserves blocks for that many generated tokens, so that
        ``append_slots`` within the reservation never finds the device full. ``tail_key``:
        storage holds the KV of the prompt's partial block before its last token under this
        key (a prefill handoff, ``fastkv.cache.handoff``); when every full block before it
        hits, it is LOADed with them, so the whole prompt but its last token is served.
        ``policy``: the tiers the request may read and write (``fastkv.cache.request_policy``).
        ``hits(device hits, host hits, storage hits)``: how many host and storage hits to load,
        the rest recomputed (``fastkv.sched.hits``); default all."""
        if self.state.paused:
            raise ValueError("allocate during a weight update: call finish_weight_update first")
        if request_id in self._reqs:
            raise ValueError(f"request {request_id!r} is already allocated")
        if not isinstance(reserve_tokens, int) or reserve_tokens < 0:
            raise ValueError(f"reserve_tokens must be an int >= 0, got {reserve_tokens!r}")
        toks = as_tokens(tokens)
        n = len(toks)
        if n == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        bs = self.block_size
        root, extras = self._chain(extra)
        keys = self._keys_of_waiting(request_id, toks, root, extras)
        dev_hits, host_hits, storage_keys = _readable(policy, *self.index.match(keys, (n - 1) // bs))
        resume_key = self.state.preemptions.resume_key(request_id)
        dev, host = self.device, self.host
        num_device_hits = len(dev_hits)
        n_blocks = cdiv(n, bs)
        n_res = cdiv(n + reserve_tokens, bs) - n_blocks
        dstate = dev.state
        cached_hits = 0
        for b in dev_hits:
            if dstate[b] == _CACHED:
                cached_hits += 1
        if dev.num_available - cached_hits - self.state.reservations.total < n_blocks - num_device_hits + n_res:
            return None
        if hits is not None:  # the hits worth their copies (fastkv.sched.hits); the rest is recomputed
            n_host, n_storage = hits(len(dev_hits), len(host_hits), len(storage_keys))
            del host_hits[n_host:], storage_keys[n_storage:]
        partial = None  # a host block holding its resumed partial block
        # a partial block (before the last token) is of use only behind a complete prefix; as the
        # last key it is the first to go when the host lacks room to stage the loads
        if len(dev_hits) + len(host_hits) + len(storage_keys) == (n - 1) // bs:
            if resume_key is not None:
                partial = self._resume_partial(resume_key, request_id, root, keys, toks, host_hits, storage_keys)
            elif tail_key is not None and (n - 1) % bs:
                storage_keys.append(tail_key)
        num_host_hits = len(host_hits)
        del self._waiting_keys[request_id]
        if self.state.residency is not None:  # the tokens its blocks' events carry, once admitted
            self.state.residency.register(keys, toks.tobytes(), bs, extra=extra)
        joins: list[tuple[int, int]] = []
        if storage_keys:  # join LOADs in flight; stage the others in host blocks, what finds no room is recomputed
            n_hits = num_device_hits + num_host_hits
            self.index.learn(storage_keys, keys[n_hits - 1] if n_hits else None)  # they are keyed on the host
            joins, storage_keys = split_loads(self.state, storage_keys)
            room = make_host_room(self.state, len(storage_keys), host_hits)
            del storage_keys[max(room, 0):]
        num_joined, num_loaded = len(joins), len(storage_keys)

        if resume_key is not None:  # resumed once: no later admission may load its partial block again
            self.state.preemptions.forget_resume(request_id)
            self.index.forget_stored(resume_key)
        stats = self.stats
        stats.requests += 1
        stats.prompt_tokens += n
        stats.prompt_blocks += len(keys)
        stats.device_hit_tokens += num_device_hits * bs

        req = CacheRecord(request_id, root, extras, keys, toks[len(keys) * bs:].tolist(), n,
                          writes=policy is None or policy.write, extra=extra)
        if keys:
            req.resume.saw_block(toks[(len(keys) - 1) * bs:len(keys) * bs].tolist())
        self.state.admit(req)
        # Hits leave the LRU queues first, so the fresh blocks taken below cannot evict them.
        dev.incref_many(dev_hits)
        host.incref_many(host_hits)
        req.host_refs = host_hits
        req.resume.resumed_on(partial)  # resumed once: let go of uncached, nothing else may match it
        plans: list[CopyPlan] = []
        first_load = num_device_hits + num_host_hits + num_joined  # table position of its first own LOAD
        if storage_keys:
            staged = take_host(self.state, len(storage_keys), pinned=True, keys=storage_keys)
            plans.append(self.copies.open(CopyKind.LOAD, Purpose.PREFIX_LOAD, dst=staged, keys=storage_keys, req=req,
                                          positions=list(range(first_load, first_load + num_loaded)),
                                          waiters=[(req, {i: first_load - num_device_hits + i
                                                          for i in range(num_loaded)})]))
        fresh, write_back = take_device(self.state, n_blocks - num_device_hits, req)
        if write_back is not None:
            plans.append(write_back)
        req.table = dev_hits + fresh
        req.num_keyed = num_device_hits
        req.num_computed = num_device_hits * bs
        loaded_upto = first_load + num_loaded
        target = min(loaded_upto * bs, n - 1)  # a resumed partial block ends at n - 1
        # loaded blocks fill their slots as they land; a joined load is served from the host, where it lands
        load = LoadProgress(target, [*host_hits, *[None] * (num_joined + num_loaded)],
                            list(range(num_device_hits, loaded_upto)),
                            planned_hits=(num_host_hits + num_joined, num_loaded))
        self.state.reservations.promise(req, n_res)
        req.pending = len(plans) + join_loads(self.state, req, joins, num_host_hits)
        req.load = load
        if req.pending == 0:
            if load.swap_pos:
                plans.append(swap_in(self.state, req))
            else:
                req.load = None
        if self.policy.copies_on_hit and num_device_hits and self.host.capacity and req.writes:
            plans += count_hits(self.state, req, num_device_hits)
        plans += deferred(self.state)
        return Allocation(tuple(req.table), num_device_hits * bs, target - num_device_hits * bs, tuple(plans),
                          req.pending == 0)

    def _resume_partial(self, resume_key: ResumeKey, rid: object, root: bytes, keys: list[BlockKey], toks: np.ndarray,
                        host_hits: list[int], storage_keys: list[bytes]) -> int | None:
        """A request this cache preempted in storage mode (its ``resume_key``) comes back with
        every full block matched: its partial last block, if these tokens are the ones it
        held KV for, is a host hit (returns the host block) or else a storage hit (None)."""
        n_full = (len(toks) - 1) // self.block_size
        if resume_key != partial_resume_key(self.state, rid, root, keys, toks[n_full * self.block_size:].tolist(),
                                            len(toks) - 1):
            return None
        hb = self.host.lookup.get(resume_key)
        if hb is not None and not storage_keys:
            host_hits.append(hb)
            return hb
        if resume_key in self.index.stored:
            storage_keys.append(resume_key)
        return None

    def reserve(self, request_id: object, num_tokens: int) -> bool:
        """Reserve device blocks so the request can grow by ``num_tokens``; False: not now."""
        req = self.state.get(request_id, ReqState.RUNNING)
        if not isinstance(num_tokens, int) or num_tokens < 0:
            raise ValueError(f"num_tokens must be an int >= 0, got {num_tokens!r}")
        need = cdiv(req.num_tokens + num_tokens, self.block_size) - len(req.table) - req.reserved
        if need <= 0:
            return True
        if self.device.num_available - self.state.reservations.total < need:
            return False
        self.state.reservations.promise(req, need)
        return True

    @settles
    def append_slots(self, request_id: object, tokens: object, ahead: int = 0) -> Growth | None:
        """Slots for tokens fed to the next step (decode): the sequence grows by ``tokens``.
        None (and nothing changed) when a new block is needed and none can be had. ``ahead``:
        also the blocks of that many tokens not known yet (async scheduling: a step in flight
        samples them); the caller appends those tokens before anything else reads the record."""
        req = self.state.get(request_id, ReqState.RUNNING)
        toks = as_tokens(tokens)
        bs = self.block_size
        need = cdiv(req.num_tokens + len(toks) + ahead, bs) - len(req.table)
        plans: tuple[CopyPlan, ...] = ()
        new: list[int] = []
        if need > 0:
            own = min(need, req.reserved)
            if self.device.num_available - self.state.reservations.total + own < need:
                return None
            self.state.reservations.take_back(req, own)
            new, write_back = take_device(self.state, need, req)
            req.table += new
            if write_back is not None:
                req.pending += 1
                plans = (write_back,)
            plans += tuple(deferred(self.state))
        req.num_tokens += len(toks)
        tail = req.tail
        tail += toks.tolist()
        if len(tail) >= bs:  # blocks just filled get their chained keys (inserted once computed)
            full = len(tail) // bs
            parent = req.keys[-1] if req.keys else req.root
            chunk = np.asarray(tail[:full * bs], dtype=np.int32)
            extras = req.extras
            if extras:
                extras = {i - len(req.keys): e for i, e in extras.items() if i >= len(req.keys)}
            new_keys = block_keys(chunk, bs, parent, 0, extras)
            if self.state.residency is not None:
                self.state.residency.register(new_keys, chunk.tobytes(), bs, 0, req.keys[-1] if req.keys else None,
                                              req.extra, at=len(req.keys))
            req.keys += new_keys
            req.resume.saw_block(tail[(full - 1) * bs:full * bs])
            del tail[:full * bs]
        return Growth(tuple(new), plans, req.pending == 0)

    @settles
    def mark_computed(self, request_id: object, num_computed_tokens: int) -> list[CopyPlan]:
        """The KV of the first ``num_computed_tokens`` tokens is on the device: their full blocks
        become cached (prompt and generated tokens alike). Returns write-through copies."""
        req = self.state.get(request_id, ReqState.RUNNING)
        n = num_computed_tokens
        if not isinstance(n, int) or not req.num_computed <= n <= req.num_tokens:
            raise ValueError(f"request {request_id!r}: num_computed_tokens {n!r} outside "
                             f"[{req.num_computed}, {req.num_tokens}]")
        req.num_computed = n
        full = min(n // self.block_size, len(req.keys))
        first = req.num_keyed
        if full <= first or not req.writes:  # a request that may not write keeps its blocks unkeyed
            return []
        if req.dup_pos:
            self._repair_dups(req)
        blocks = req.table[first:full]
        keys = req.keys[first:full]
        if self.host.capacity:  # the map serves the host alone (parents of the keys its copies bring)
            self.index.learn_span(req.keys, first, full)
        dups = self.device.insert_many(blocks, keys, req.keys[first - 1:full - 1] if first else [None, *keys[:-1]])
        req.num_keyed = full
        if dups:
            req.dup_pos += [first + i for i in dups]
            self.stats.duplicate_blocks += len(dups)
        self.stats.inserted_blocks += full - first - len(dups)
        if self.policy.copies_on_insert and self.host.capacity:
            dkey = self.device.key
            mine = [(b, k) for b, k in zip(blocks, keys, strict=True) if dkey[b] is k]
            late = retry_skipped(self.state)  # first: older, parents of these perhaps
            return late + request_copies(self.state, req, mine, full) + deferred(self.state)
        return deferred(self.state)

    def _repair_dups(self, req: CacheRecord) -> None:
        """Key the request's duplicate blocks whose original holder has been evicted or is only
        cached, so that the children it inserts next hang under a present parent."""
        dev = self.device
        pos = [i for i in req.dup_pos if dev.key[req.table[i]] is None]
        self.index.learn_at(req.keys, pos)
        left = dev.insert_many([req.table[i] for i in pos], [req.keys[i] for i in pos])
        req.dup_pos = [pos[j] for j in left]

    # ================================================================== release
    @settles
    def free(self, request_id: object, cache: bool = True) -> None:
        """The request is done (or aborted, or preempted for recompute). Its full computed
        blocks stay cached unless ``cache`` is False (or it may not write: they were never
        keyed, so they are freed); copies still in flight finish first."""
        req = self.state.let_go(request_id)
        if req is None:
            raise ValueError(f"free of unknown request {request_id!r} (double free?)")
        req.state = ReqState.FREED
        self.state.reservations.take_back(req)
        release_table(self.state, req, cache)
        release_host_refs(self.state, req, cache)

    # ================================================================== preemption
    @settles
    def offload(self, request_id: object, to_storage: bool = False) -> tuple[CopyPlan, ...] | None:
        """Copy the request's computed KV to the host (see fastkv.cache.offload); ``to_storage``:
        and to the storage tier, its partial last block included (storage-mode preemption).
        ValueError for a request whose cache policy lets it write nothing: it recomputes."""
        if not self.state.get(request_id).writes:
            raise ValueError(f"offload of request {request_id!r}, whose cache policy lets it write nothing")
        return offload_request(self.state, request_id, to_storage and self.index.storage)

    def is_offloaded(self, request_id: object) -> bool:
        """OFFLOADED: its KV is on the host (an offload that had nothing to copy is at once)."""
        return self.state.get(request_id).state is ReqState.OFFLOADED

    def preemption_work(self, request_id: object) -> PreemptionWork:
        """What offloading or recomputing the request would do now (see fastkv.cache.offload)."""
        return preemption_work(self.state, request_id)

    @settles
    def restore(self, request_id: object, reserve_tokens: int = 0) -> Allocation | None:
        """Bring an OFFLOADED request back onto the device (see fastkv.cache.offload)."""
        return restore_request(self.state, request_id, reserve_tokens)

    # ================================================================== copies
    @settles
    def complete(self, plan: CopyPlan, ok: bool) -> Completion:
        """A copy finished on every rank (``ok``) or failed on one. Returns what follows."""
        rec = self.copies.close(plan)
        if not ok:
            self.stats.failed_copies += 1
        c = finish(self.state, rec, bool(ok))
        more = retry_skipped(self.state) + deferred(self.state)  # the copy may have freed host blocks
        return c._replace(plans=c.plans + tuple(more)) if more else c

    @settles
    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in every tier (vLLM's reset_prefix_cache):
        CACHED device and host blocks, and every key the index knows in storage. Held and
        in-flight blocks keep their keys: their requests still use them. Returns the count."""
        dropped = 0
        for pool, tier in ((self.device, Tier.DEVICE), (self.host, Tier.HOST)):
            keys = [pool.evict(b) for b in list(pool.evictable)]
            self.state.through.forget_hits(keys)
            self.index.gone_many(keys, tier, Cause.RESET)
            dropped += len(keys)
            for k in keys:  # children held or in flight then, cached later, would be stranded
                note_lost(self.state, k)
        stored = self.state.forget_stored(Cause.RESET)
        dropped += len(stored)
        for k in stored:  # a parent only storage had: its children held or in flight are stranded too
            note_lost(self.state, k)
        if self.state.residency is not None:
            self.state.residency.cleared()
        return dropped

    # ================================================================== prefill handoff
    def tail_key(self, tokens: object, handoff_id: str, keys: list[BlockKey] | None = None) -> TailKey | None:
        """The storage key of the partial block before the last of ``tokens`` in a prefill handoff
        named ``handoff_id`` (None: it has none). ``keys``: the prompt's ``keys_for``, if known."""
        toks = as_tokens(tokens)
        if keys is None:
            keys = self.keys_for(toks)
        return handoff.tail_key(self.state, keys, self.state.root, handoff_id, toks.tolist())

    @settles
    def export(self, request_id: object, upto: int, tail: TailKey | None) -> tuple[list[bytes], list[CopyPlan]]:
        """Copy the KV of the request's first ``upto`` tokens to storage, for a decode engine
        (``fastkv.cache.handoff.export``): the keys it will find them under, and the plans."""
        return handoff.export(self.state, request_id, upto, tail)

    def exported(self, keys: list[bytes]) -> bool | None:
        """True: storage holds every key of an export; None: some are on their way; False: lost."""
        return handoff.exported(self.state, keys)

    @settles
    def retry_export(self, keys: list[bytes]) -> list[CopyPlan]:
        """Copy again what of an export is neither stored nor moving (``fastkv.cache.handoff.retry``)."""
        return handoff.retry(self.state, keys)

    def release_export(self, keys: list[bytes]) -> None:
        """The export of ``keys`` is over: let go of the device blocks it held."""
        handoff.release(self.state, keys)

    # ================================================================== weight updates
    def begin_weight_update(self) -> ClearTask:
        """Drop every cached block (its KV belongs to the old weights) and pause admission.
        Needs no request and no copy in flight."""
        if self._reqs:
            raise ValueError(f"weight update with requests still allocated: {list(self._reqs)[:8]}")
        if self.copies.records:
            raise ValueError(f"weight update with copies in flight: plans {sorted(self.copies.records)[:8]}")
        if self.state.handoff_holds:  # a retry after the CLEAR would copy cleared memory under old keys
            raise ValueError(f"weight update with {len(self.state.handoff_holds)} device blocks held by "
                             "prefill exports")
        if self.state.paused:
            raise ValueError("weight update already in progress")
        for k in self.index.clear():
            self.index.gone(k, Tier.DEVICE, Cause.WEIGHT_UPDATE)
        if self.state.residency is not None:
            self.state.residency.cleared()
        self.state.through.forget_all()
        self.state.weights.begin_update()
        return self.copies.open_control(ClearTask)

    def finish_weight_update(self, weights_version: str) -> RestoreTask:
        """New weights are loaded: switch to their namespace and accept requests again."""
        if not self.state.paused:
            raise ValueError("finish_weight_update without begin_weight_update")
        version = str(weights_version)
        if any(ns.weights_version == version for ns in self.state.retired[-1:]):
            raise ValueError(f"weights version {version!r} is the one being replaced")
        self.state.weights.finish_update(version)
        # the transfer processes reopen storage under this version's namespace
        return self.copies.open_control(lambda plan_id: RestoreTask(plan_id, version))

    # ================================================================== KV events
    def watch_residency(self, log: ResidencyLog) -> ResidencyLog:
        """Report every key each tier gains or loses to ``log`` (fastkv.cache.residency)."""
        return watch(self.state, log)

    # ================================================================== diagnostics
    def explain_miss(self, tokens: object, extra: ExtraKeys | None = None) -> MissExplanation:
        """Why the first block of ``tokens`` that no tier holds is missing."""
        toks = as_tokens(tokens)
        root, extras = self._chain(extra)
        keys = block_keys(toks, self.block_size, root, 0, extras)
        present = self.index.present
        i = 0
        while i < len(keys) and present(keys[i]):
            i += 1
        n = len(keys)
        if i == n:
            return MissExplanation(MissReason.HIT, i, n)
        k = keys[i]
        pid = self.copies.inflight.get(k)
        if pid is not None:
            return MissExplanation(MissReason.IN_FLIGHT, i, n, detail=f"plan {pid} is copying it")
        rec = self.index.history.get(k)
        if rec is not None:
            tier, cause = rec
            if cause is not Cause.WEIGHT_UPDATE:
                return MissExplanation(MissReason.EVICTED, i, n, tier, cause, self.policy,
                                       f"left the {tier.name.lower()} tier ({cause.name}) under {self.policy.name}")
        for ns in reversed(self.state.retired):
            old_root = root_key(ns, extra)
            old = block_keys(toks[:(i + 1) * self.block_size], self.block_size, old_root, 0, extras)
            if old[i] in self.index.history:
                return MissExplanation(MissReason.OTHER_NAMESPACE, i, n, detail=f"cached under weights "
                                       f"{ns.weights_version!r}, now {self.namespace.weights_version!r}")
        return MissExplanation(MissReason.NEVER_STORED, i, n)

    def check_integrity(self) -> None:
        """Assert every invariant of the pools, the index, the requests and the copies."""
        check(self.state)

    def check_request(self, request_id: object) -> None:
        """Assert every block in the request's device table is held, and that one it shares
        with another request holds a prefix key (two requests writing one block corrupt one)."""
        dev = self.device
        for b in self.state.get(request_id).table:
            assert dev.ref[b] > 0 and dev.state[b] in _HELD, \
                f"request {request_id}: block {b} in its table is {BlockState(dev.state[b]).name} " \
                f"with refcount {dev.ref[b]}"
            assert dev.ref[b] == 1 or dev.key[b] is not None, \
                f"device block {b} shared by {dev.ref[b]} requests but holds no prefix key"

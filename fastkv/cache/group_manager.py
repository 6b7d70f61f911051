"""GroupedManager: the scheduler's cache for a sliding-window hybrid layout, over ``GroupedCache``.

A hybrid layout's groups hold different blocks (``fastkv.cache.groups``): a full group every
block of a request, a sliding group only its window's tail. This facade speaks the part of
``CacheManager``'s interface that the scheduler uses on the device tier (admission, slots,
computed tokens, release, preemption by recompute, prefix hits that every group serves) and
hands each step one table per group (``step_table``: -1 where a sliding group holds nothing).

What differs from ``CacheManager``: a sliding group cannot hold a whole prompt, so blocks are
taken per step for the chunk the step computes (``step_table``, from the batch), not at
admission; admission reserves them (``GroupedCache.allocate``). A decode's growth
(``append_slots``) takes the next token's blocks at once, so a lack of room is a None there and
the scheduler preempts, as for the all-full cache. Async scheduling: a step planned while the
request's previous step is in flight starts where that one ends; the group core is told that
step's tokens are computed first (their blocks keyed, the slid-out ones given back). That is safe
without copies: every worker runs its steps in order, so the step in flight has read and
written them before any later step can. The scheduler's count of computed tokens
(``num_computed_tokens``) still moves only with ``mark_computed``.

Preemption by offload (``host_group_blocks``: host blocks per group): ``offload`` copies per
group the blocks its table holds (a sliding group its window's tail) into that group's host
pool, one SWAP_OUT per group tagged with the group (``CopyPlan.group``); ``restore`` swaps them
back into fresh device blocks, exactly what every layer reads from there on
(``fastkv.cache.group_tiers``, ``fastkv.cache.group_copies``). Storage, the prefill handoff and
weight updates are refused for a hybrid layout at start-up (``RunSpec``). KV events
(``watch_residency``) report each group's device pool, every event tagged with its group.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from fastkv.cache import group_tiers
from fastkv.cache.group_copies import GroupCopies
from fastkv.cache.groups import GroupedCache
from fastkv.cache.index import MatchResult
from fastkv.cache.keys import ExtraKeys, KeyNamespace, as_tokens, block_keys, root_key
from fastkv.cache.plan import Allocation, Completion, CopyKind, CopyPlan, Growth, PreemptionWork, Ready
from fastkv.cache.pool import BlockPool, BlockState
from fastkv.cache.request_policy import CachePolicy
from fastkv.cache.requests import ReqState
from fastkv.cache.residency import GroupedResidency
from fastkv.cache.state import CacheConfig, CacheStats
from fastkv.config import cdiv

_CACHED = int(BlockState.CACHED)


@dataclass
class _Rec:
    """One request's keys and tokens: what ``GroupedCache`` does not keep."""

    root: bytes
    extras: dict[int, bytes] | None
    keys: list[bytes]
    tail: list[int]  # tokens after the last full block
    num_tokens: int
    chunk: int
    writes: bool
    computed: int  # tokens the scheduler was told are computed (mark_computed)
    readable: bool = True
    extra: ExtraKeys | None = field(default=None, repr=False)


class GroupedManager:
    """``CacheManager``'s scheduler-facing calls over one device pool per KV cache group
    (module docstring). ``group_blocks``: device blocks per group; ``max_chunk``: the most
    tokens a step computes for one request (the scheduler's ``max_num_batched_tokens``);
    ``host_group_blocks``: host blocks per group, for preemption by offload (() none)."""

    def __init__(self, config: CacheConfig, group_blocks: tuple[int, ...], max_chunk: int,
                 host_group_blocks: tuple[int, ...] = ()) -> None:
        layout = config.layout
        if layout is None or not layout.is_hybrid:
            raise ValueError("GroupedManager is for a sliding-window hybrid layout (KVLayout.windows)")
        if max_chunk <= 0:
            raise ValueError(f"max_chunk must be > 0, got {max_chunk!r}")
        self.groups = GroupedCache(layout, list(group_blocks), config.eviction, list(host_group_blocks) or None)
        self.copies = GroupCopies(self.groups)
        full = [i for i, gp in enumerate(self.groups.groups) if not gp.group.window]
        self._primary = full[0] if full else 0  # its capacity bounds a context; its hits count
        # the scheduler sizes max_model_len and its load budget by num_device_blocks: the primary group's
        self.config = dataclasses.replace(config, num_device_blocks=group_blocks[self._primary])
        self.block_size = config.block_size
        self.policy = config.policy
        self.max_chunk = int(max_chunk)
        self.stats = CacheStats()
        self.device = self.groups.groups[self._primary].pool
        self.host = BlockPool("host", 0, config.eviction)
        self.namespace: KeyNamespace = config.namespace()
        self._root = root_key(self.namespace)
        self._recs: dict[object, _Rec] = {}
        # per group, the most blocks one request held between its steps (after its KV was computed)
        self.peak_held = [0] * len(self.groups.groups)
        # per group, the blocks offloads copied out, and the most one offload copied
        self.offloaded_blocks = [0] * len(self.groups.groups)
        self.peak_offloaded = [0] * len(self.groups.groups)
        self.residency: GroupedResidency | None = None  # set by watch_residency while KV events are on

    # ================================================================== queries
    def _chain(self, extra: ExtraKeys | None) -> tuple[bytes, dict[int, bytes] | None]:
        if extra is None:
            return self._root, None
        if not isinstance(extra, ExtraKeys):
            raise TypeError(f"extra must be an ExtraKeys, got {type(extra).__name__}")
        return root_key(self.namespace, extra), (extra.block_extras(self.block_size) or None)

    def keys_for(self, tokens: object, extra: ExtraKeys | None = None) -> list[bytes]:
        root, extras = self._chain(extra)
        return block_keys(as_tokens(tokens), self.block_size, root, 0, extras)

    def match(self, tokens: object, extra: ExtraKeys | None = None, policy: CachePolicy | None = None) -> MatchResult:
        """The longest prefix every group serves (read-only); its blocks are the primary group's."""
        toks = as_tokens(tokens)
        n = 0
        if policy is None or policy.readable:
            n = self.groups.match(self.keys_for(toks, extra), len(toks))
        keys = self.keys_for(toks[:n * self.block_size], extra) if n else []
        lookup = self.device.lookup
        return MatchResult(tuple(lookup.get(k, -1) for k in keys), (), (), self.block_size, len(toks))

    def num_held_hits(self, match: MatchResult) -> int:
        state = self.device.state
        return sum(1 for b in match.device_blocks if b >= 0 and state[b] != _CACHED)

    @property
    def num_free_device_blocks(self) -> int:
        """What the group with the least room can still hand out: a growth that found no room
        is short there (the scheduler preempts rather than waits for room no copy will free)."""
        return min(gp.available for gp in self.groups.groups)

    def never_fits(self, prompt_tokens: int) -> str | None:
        """Why a prompt of ``prompt_tokens`` could never be admitted, or None: a sliding group with
        fewer blocks than the request reserves there while it prefills (its chunk's bound). A full
        group's bound is the scheduler's ``max_model_len`` (its blocks: ``config.num_device_blocks``)."""
        chunk = min(self.max_chunk, prompt_tokens)
        for gp in self.groups.groups:
            bound = gp.group.max_blocks(self.block_size, chunk)
            if bound is not None and bound > gp.pool.capacity:
                return (f"a prefill chunk of {chunk} tokens needs {bound} blocks of the sliding-window "
                        f"{gp.group.window} KV cache group, which has {gp.pool.capacity}")
        return None

    @property
    def has_host_tier(self) -> bool:
        """Whether every group has host blocks to offload to."""
        return all(gp.host.capacity for gp in self.groups.groups)

    @property
    def takes_blocks_per_step(self) -> bool:
        """True: ``step_table`` takes them; nothing is taken ahead of a token (async scheduling)."""
        return True
    num_export_holds = 0

    @property
    def host_occupancy(self) -> float:
        """The most any group's host pool is taken (0 without a host tier)."""
        return max((1.0 - gp.host.num_free / gp.host.capacity for gp in self.groups.groups if gp.host.capacity),
                   default=0.0)

    def queued_blocks(self) -> tuple[int, int]:
        return 0, 0

    def skipped_stores(self) -> dict[str, int]:
        return {}

    def copies_in_flight(self) -> set[int]:
        return self.copies.in_flight()

    def has_copies_in_flight(self) -> bool:
        return bool(self.copies.flights)

    def request_ids(self) -> list[object]:
        """The requests the scheduler holds here (not those freed while their copies fly)."""
        flights = self.copies.flights
        return [rid for rid in self._recs if rid not in flights or not flights[rid].freed]

    def _rec(self, request_id: object) -> _Rec:
        info = self._recs.get(request_id)
        if info is None:
            raise ValueError(f"unknown request {request_id!r}")
        return info

    def request_state(self, request_id: object) -> ReqState:
        self._rec(request_id)
        if self.is_offloaded(request_id):
            return ReqState.OFFLOADED
        return ReqState.OFFLOADING if self.groups.record(request_id).state == "offloading" else ReqState.RUNNING

    def is_ready(self, request_id: object) -> bool:
        self._rec(request_id)
        return self.groups.record(request_id).state == "running"

    def is_restoring(self, request_id: object) -> bool:
        """Its restore's copies are in flight: ``offload`` makes it OFFLOADED again with no copy."""
        f = self.copies.flights.get(request_id)
        return f is not None and f.kind is CopyKind.SWAP_IN and not f.cancelled

    def is_offloaded(self, request_id: object) -> bool:
        """OFFLOADED: its KV is on the host (a restore preempted in flight is at once)."""
        state = self.groups.record(request_id).state
        f = self.copies.flights.get(request_id)
        return state == "offloaded" or (f is not None and f.cancelled)

    def num_computed_tokens(self, request_id: object) -> int:
        return self._rec(request_id).computed

    def block_table(self, request_id: object) -> np.ndarray:
        """Per group the request's table, [groups, blocks] (-1: a block the group does not hold)."""
        return _stack(self.groups.tables(request_id), 0)

    def step_table(self, request_id: object, start: int, count: int) -> np.ndarray | None:
        """The tables for a step computing positions [start, start + count): blocks taken as the
        step needs them. None (nothing changed) when a group has no room: the request waits."""
        info = self._rec(request_id)
        if count > info.chunk:
            return None
        if start > self.groups.record(request_id).num_computed:  # a step in flight computes up to start
            self._computed(request_id, start, info)
        tables = self.groups.slots(request_id, start, count)
        return None if tables is None else _stack(tables, cdiv(start + count, self.block_size))

    # ================================================================== admission
    def allocate(self, request_id: object, tokens: object, extra: ExtraKeys | None = None,
                 reserve_tokens: int = 0, tail_key: bytes | None = None, policy: CachePolicy | None = None,
                 hits: object = None) -> Allocation | None:
        """Admit a prompt, reusing the longest prefix every group serves. None: a group lacks room
        for its reservation (``GroupedCache.allocate``). ``reserve_tokens`` and ``hits`` have no
        use here: growth takes from the primary group's room, and every hit is on the device."""
        if tail_key is not None:
            raise ValueError("a prefill handoff's tail key: not supported for a sliding-window hybrid layout yet")
        if request_id in self._recs:
            raise ValueError(f"request {request_id!r} is already allocated")
        toks = as_tokens(tokens)
        n = len(toks)
        if n == 0:
            raise ValueError(f"request {request_id!r}: empty prompt")
        root, extras = self._chain(extra)
        keys = block_keys(toks, self.block_size, root, 0, extras)
        readable = policy is None or bool(policy.readable)
        chunk = min(self.max_chunk, n)
        if extra is not None and extra.mm:  # a step never splits an item: it may take one past the budget
            chunk = min(n, max(chunk, *(end - start for start, end, _ in extra.mm)))
        first = self.groups.allocate(request_id, keys if readable else [], n, chunk)
        if first is None:
            return None
        bs = self.block_size
        if self.residency is not None:  # the tokens its blocks' events carry
            self.residency.register(keys, toks.tobytes(), bs, extra=extra)
        self._recs[request_id] = _Rec(root, extras, keys, toks[len(keys) * bs:].tolist(), n, chunk,
                                      policy is None or policy.write, first, readable, extra)
        st = self.stats
        st.requests += 1
        st.prompt_tokens += n
        st.prompt_blocks += len(keys)
        st.device_hit_tokens += first
        return Allocation((), first, 0, (), True)

    # ================================================================== steps
    def append_slots(self, request_id: object, tokens: object, ahead: int = 0) -> Growth | None:
        """The sequence grows by ``tokens`` (decode) and their slots are taken now, so a lack of
        room is a None here (nothing changed) and the scheduler preempts."""
        if ahead:
            raise ValueError("slots ahead of a token: a hybrid's step_table takes them (takes_blocks_per_step)")
        info = self._rec(request_id)
        toks = as_tokens(tokens)
        start = self.groups.record(request_id).num_computed
        end = info.num_tokens + len(toks)
        if end > start and self.groups.slots(request_id, start, min(end - start, info.chunk)) is None:
            return None
        info.num_tokens = end
        info.tail += toks.tolist()
        bs = self.block_size
        if len(info.tail) >= bs:  # blocks just filled get their chained keys (keyed once computed)
            full = len(info.tail) // bs
            parent = info.keys[-1] if info.keys else info.root
            extras = info.extras
            if extras:
                extras = {i - len(info.keys): e for i, e in extras.items() if i >= len(info.keys)}
            chunk = np.asarray(info.tail[:full * bs], np.int32)
            new_keys = block_keys(chunk, bs, parent, 0, extras)
            if self.residency is not None:
                self.residency.register(new_keys, chunk.tobytes(), bs, 0, info.keys[-1] if info.keys else None,
                                        info.extra, at=len(info.keys))
            info.keys += new_keys
            del info.tail[:full * bs]
        return Growth((), (), True)

    def mark_computed(self, request_id: object, num_computed_tokens: int) -> list[CopyPlan]:
        """The first ``num_computed_tokens`` tokens' KV is on the device: full blocks are keyed,
        sliding groups let go of what slid out; a request with nothing left to compute decodes
        from now on (its sliding groups reserve a decode's bound)."""
        info = self._rec(request_id)
        n = num_computed_tokens
        if not info.computed <= n <= info.num_tokens:
            raise ValueError(f"request {request_id!r}: num_computed_tokens {n!r} outside "
                             f"[{info.computed}, {info.num_tokens}]")
        info.computed = n
        if n > self.groups.record(request_id).num_computed:  # else told already (step_table)
            self._computed(request_id, n, info)
        if n == info.num_tokens and info.chunk > 1:
            info.chunk = 1
            self.groups.set_chunk(request_id, 1)
        return []

    def _computed(self, request_id: object, n: int, info: _Rec) -> None:
        """Tell the group core; what the request holds then, before its next step takes blocks,
        is what it holds between steps."""
        self.groups.computed(request_id, n, info.keys if info.writes else [])
        for i, held in enumerate(self.groups.held_blocks(request_id)):
            self.peak_held[i] = max(self.peak_held[i], held)

    # ================================================================== preemption by offload
    def preemption_work(self, request_id: object) -> PreemptionWork:
        """What offloading or recomputing the request would do now: the blocks an offload copies,
        in all-layer blocks (a group's block is its layers' share), and the tokens a recompute computes."""
        info = self._rec(request_id)
        layers = self.groups.layout.num_layers
        held = self.groups.held_blocks(request_id)
        share = sum(n * len(gp.group.layers) for n, gp in zip(held, self.groups.groups, strict=True))
        return PreemptionWork(cdiv(share, layers), info.computed, 0)

    def offload(self, request_id: object, to_storage: bool = False) -> tuple[CopyPlan, ...] | None:
        """Copy, per group, the blocks the request holds to that group's host pool. The device
        blocks go when every group's copy is done (``complete``: ``Completion.offloaded``). A
        request whose restore is in flight is OFFLOADED at once, with no copy. None: a group's
        host pool lacks room (nothing changed)."""
        if to_storage:
            raise ValueError("preemption to storage: not supported for a sliding-window hybrid layout yet")
        info = self._rec(request_id)
        if not info.writes:
            raise ValueError(f"offload of request {request_id!r}, whose cache policy lets it write nothing")
        if self.is_restoring(request_id):
            self.copies.flights[request_id].cancelled = True
            return ()
        if not self.has_host_tier:
            raise ValueError("offload needs a host tier (host blocks for every KV cache group)")
        copies = group_tiers.offload(self.groups, request_id)
        if copies is None:
            return None
        plans = self.copies.start(request_id, CopyKind.SWAP_OUT, copies)
        self.stats.swap_out_blocks += sum(p.num_blocks for p in plans)
        for c in copies:
            self.offloaded_blocks[c.group] += c.plan.num_blocks
            self.peak_offloaded[c.group] = max(self.peak_offloaded[c.group], c.plan.num_blocks)
        return plans

    def restore(self, request_id: object, reserve_tokens: int = 0) -> Allocation | None:
        """Swap an OFFLOADED request's host blocks back into fresh device blocks, per group, with
        room reserved for ``reserve_tokens`` more tokens. None: a group lacks room (or the copies
        of a restore preempted in flight have not landed yet)."""
        info = self._rec(request_id)
        if request_id in self.copies.flights:
            return None
        req = self.groups.record(request_id, "offloaded")
        before = req.num_tokens
        req.num_tokens = max(before, info.num_tokens + reserve_tokens)  # the reservations cover them
        copies = group_tiers.restore(self.groups, request_id)
        if copies is None:
            req.num_tokens = before
            return None
        plans = self.copies.start(request_id, CopyKind.SWAP_IN, copies)
        self.stats.swap_in_blocks += sum(p.num_blocks for p in plans)
        return Allocation((), 0 if plans else info.computed, info.computed if plans else 0, plans, not plans)

    def complete(self, plan: CopyPlan, ok: bool) -> Completion:
        """One group's copy finished on every rank (``ok``) or failed on one. What follows once
        the request's last one is: offloaded (or failed: still running on its device blocks), or
        ready again (a failed restore lost its KV: it computes from token 0)."""
        done = self.copies.landed(plan, ok)
        if not ok:
            self.stats.failed_copies += 1
        if not done:
            return Completion()
        rid, f = done
        if f.kind is CopyKind.SWAP_OUT:
            group_tiers.offloaded(self.groups, rid, f.ok)
            if f.freed:
                self._let_go(rid, cache=True)
                return Completion()
            return Completion(offloaded=(rid,)) if f.ok else Completion(offload_failed=(rid,))
        if f.cancelled:
            group_tiers.unrestore(self.groups, rid)
            if f.freed:
                self._let_go(rid, cache=False)
            return Completion()
        group_tiers.restored(self.groups, rid, f.ok)  # a failed one frees the request in the group core
        if f.freed:
            if f.ok:
                self._let_go(rid, cache=False)
            else:
                self._recs.pop(rid)
            return Completion()
        info = self._recs[rid]
        if not f.ok:
            info.chunk, info.computed = min(self.max_chunk, info.num_tokens), 0
            if self.groups.allocate(rid, [], info.num_tokens, info.chunk) is None:
                raise RuntimeError(f"request {rid!r}: its restore failed and no KV cache group has room to "
                                   "recompute it")
        return Completion(ready=(Ready(rid, info.computed),))

    # ================================================================== release
    def free(self, request_id: object, cache: bool = True) -> None:
        """Done, aborted or preempted by recompute: keyed blocks stay cached unless ``cache`` is False.
        A request whose copies fly is let go of once they land (``complete``)."""
        info = self._recs.get(request_id)
        f = self.copies.flights.get(request_id)
        if info is None or (f is not None and f.freed):
            raise ValueError(f"free of unknown request {request_id!r} (double free?)")
        if f is not None:
            f.freed = True
            return
        self._let_go(request_id, cache)

    def _let_go(self, request_id: object, cache: bool) -> None:
        info = self._recs.pop(request_id)
        self.groups.free(request_id, cache=cache and info.writes)

    def reset_prefix_cache(self) -> int:
        """Drop every cached block no request holds, in every group."""
        dropped = 0
        for gp in self.groups.groups:
            for b in list(gp.pool.evictable):
                gp.pool.evict(b)
                dropped += 1
        if self.residency is not None:
            self.residency.cleared()
        return dropped

    # ================================================================== KV events
    def watch_residency(self, log: object = None) -> GroupedResidency:
        """Report every key each group's device pool gains or loses, per group
        (``GroupedResidency``: one log per group, so ``log`` is not used)."""
        self.residency = GroupedResidency(self.groups.groups)
        return self.residency

    # ================================================================== diagnostics
    def group_summary(self) -> list[dict[str, int]]:
        """Per group: its window and layers, its device blocks, the blocks held now, the most one
        request held between its steps, the blocks admissions found there (its hits), and those
        offloads copied out (all, and the most one offload did)."""
        return [{"window": gp.group.window, "layers": len(gp.group.layers), "blocks": gp.pool.capacity,
                 "held": gp.pool.num_allocated, "cached": gp.pool.num_cached,
                 "max_held_per_request": self.peak_held[i], "hit_blocks": gp.hit_blocks,
                 "host_blocks": gp.host.capacity, "offloaded_blocks": self.offloaded_blocks[i],
                 "max_offloaded_per_request": self.peak_offloaded[i]}
                for i, gp in enumerate(self.groups.groups)]

    def check_integrity(self) -> None:
        self.groups.check_integrity()
        assert set(self._recs) == set(self.groups.request_ids()), "requests differ from the group core's"

    def check_request(self, request_id: object) -> None:
        self._rec(request_id)


def _not_yet(name: str):
    def refuse(self, *args: object, **kwargs: object) -> None:
        raise ValueError(f"{name}: not supported for a sliding-window hybrid layout yet")
    refuse.__name__ = name
    return refuse


# CacheManager's calls for storage, the prefill handoff and weight updates: the run
# refuses their flags for a hybrid at start-up, and an embedding caller gets one clear line here
for _name in ("export", "exported", "retry_export", "release_export",
              "tail_key", "confirm_stored", "begin_weight_update", "finish_weight_update",
              "explain_miss", "reserve"):
    setattr(GroupedManager, _name, _not_yet(_name))


def _stack(tables: list[np.ndarray], width: int) -> np.ndarray:
    """Per-group tables as one [groups, max(width, longest)] int32 array, -1 past each table's end."""
    n = max([width, *(len(t) for t in tables)])
    out = np.full((len(tables), n), -1, np.int32)
    for g, t in enumerate(tables):
        out[g, :len(t)] = t
    return out

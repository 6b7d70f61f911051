"""Which keys each tier holds, as a stream of changes: what KV events are made of.

A key is resident in a tier exactly while it is in that tier's residency map: the device and
host pools' ``lookup`` (a key is set there only once its bytes are valid, so never in flight)
and the index's ``stored`` (keys this engine stored, or that a lookup found in the pool). Every
change of residency is a change of one of these three maps, so the observer watches the maps
themselves: ``watch`` swaps each for an ``ObservedMap`` / ``ObservedOrderedMap`` that reports
each key added or removed to a ``ResidencyLog``. Off (the default) the maps stay plain dicts
and cost nothing; on, each mutation costs one Python call. The cache core calls the log in
two more places only: ``register`` when it derives a request's chained keys (the tokens an
event carries), and ``cleared`` after a weight update or ``reset_prefix_cache``.

The log keeps, per tier, the net change since the last ``take``: a key added and removed within
one step is no change. Only chained keys count (``register``ed with their tokens): private,
resume and handoff keys name partial blocks no other request can match, and are left out.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from fastkv.cache.keys import ExtraKeys
from fastkv.cache.write_policy import Tier

TIERS = tuple(Tier)
PENDING_KEYS = 1 << 16  # chained keys remembered before any tier holds them (a newer one pushes the oldest out)


class KeyInfo(NamedTuple):
    parent: bytes | None  # None: the first block of its chain
    tokens: bytes  # int32 token ids of the block
    lora: str | int | None = None  # the adapter of its chain
    items: tuple[bytes, ...] = ()  # hashes of the multimodal items it overlaps (never the tenant's salt)


class GroupTag(NamedTuple):
    """The KV cache group a change is of, as vLLM's events name it (a hybrid layout's only)."""

    index: int  # group_idx
    kind: str  # kv_cache_spec_kind: "full_attention" or "sliding_window"
    window: int | None  # kv_cache_spec_sliding_window: None for full attention


class Change(NamedTuple):
    """One step's net residency change of one tier (of one KV cache group: ``group``; None for
    the all-full layout's one), in the order keys changed."""

    tier: Tier
    stored: list[tuple[bytes, KeyInfo]]
    removed: list[bytes]
    group: GroupTag | None = None


class ResidencyLog:
    """Net per-tier changes of the residency maps since the last ``take``."""

    def __init__(self, pending: int = PENDING_KEYS) -> None:
        self.added: dict[Tier, dict[bytes, None]] = {t: {} for t in Tier}
        self.removed: dict[Tier, dict[bytes, None]] = {t: {} for t in Tier}
        self.pending: OrderedDict[bytes, KeyInfo] = OrderedDict()  # chained keys no tier holds yet
        self.pending_size = pending
        self.announced: dict[bytes, list] = {}  # resident chained key -> [KeyInfo, tier bitmask]
        self.clears = 0  # AllBlocksCleared not yet taken
        self.dirty = False  # a change since the last take
        self.maps: dict[Tier, dict] = {}

    # ---------------------------------------------------------------- from the maps
    def add(self, tier: Tier, key: bytes) -> None:
        self.dirty = True
        removed = self.removed[tier]
        if key in removed:
            del removed[key]
        else:
            self.added[tier][key] = None

    def remove(self, tier: Tier, key: bytes) -> None:
        self.dirty = True
        added = self.added[tier]
        if key in added:
            del added[key]
        else:
            self.removed[tier][key] = None

    # ---------------------------------------------------------------- from the cache
    def register(self, keys: list[bytes], tokens: bytes, block_size: int, first: int = 0,
                 parent: bytes | None = None, extra: ExtraKeys | None = None, at: int | None = None) -> None:
        """``keys[i]`` is the chained key of block ``first + i`` of ``tokens`` (int32 bytes of the
        whole sequence); ``parent``: the key before ``keys[0]`` (None at the root); ``extra``: the
        request's extras, whose adapter and item hashes the events carry; ``at``: the index of
        ``keys[0]`` in its chain, where ``tokens`` starts later than the chain (``first`` by default)."""
        pending, step = self.pending, block_size * 4
        off = first * step
        lora = extra.lora_id if extra is not None else None
        items = extra.block_items(block_size) if extra is not None and extra.mm else {}
        for i, k in enumerate(keys, start=first if at is None else at):
            if k not in self.announced:
                pending[k] = KeyInfo(parent, tokens[off:off + step], lora, items.get(i, ()))
                pending.move_to_end(k)
            parent = k
            off += step
        while len(pending) > self.pending_size:
            pending.popitem(last=False)

    def cleared(self) -> None:
        """Every tier was emptied or pruned at once (weight update, reset_prefix_cache): the
        subscriber drops all it knows (AllBlocksCleared), and what is still resident (blocks that
        running requests hold through a reset) is announced again."""
        self.clears += 1
        self.dirty = True
        for k, (info, _) in self.announced.items():
            self.pending[k] = info
        self.announced.clear()
        for t in Tier:
            self.removed[t].clear()
            self.added[t] = dict.fromkeys(self.maps[t]) if t in self.maps else {}

    # ---------------------------------------------------------------- to the publisher
    def take(self) -> tuple[int, list[Change]]:
        """(AllBlocksCleared count, changes per tier) since the last take; resets the log."""
        if not self.dirty:
            return 0, []
        self.dirty = False
        clears, self.clears = self.clears, 0
        out: list[Change] = []
        announced, pending = self.announced, self.pending
        for t in TIERS:
            added, removed = self.added[t], self.removed[t]
            if not added and not removed:
                continue
            bit = 1 << int(t)
            gone: list[bytes] = []
            for k in removed:
                entry = announced.get(k)
                if entry is None or not entry[1] & bit:
                    continue  # a private key, never announced
                gone.append(k)
                entry[1] &= ~bit
                if not entry[1]:
                    del announced[k]
                    pending[k] = entry[0]
            new: list[tuple[bytes, KeyInfo]] = []
            for k in added:
                entry = announced.get(k)
                if entry is None:
                    info = pending.pop(k, None)
                    if info is None:
                        continue  # not a chained key: a partial block's private key
                    entry = announced[k] = [info, 0]
                entry[1] |= bit
                new.append((k, entry[0]))
            added.clear()
            removed.clear()
            if new or gone:
                out.append(Change(t, new, gone))
        while len(pending) > self.pending_size:
            pending.popitem(last=False)
        return clears, out

    def resident(self, tier: Tier) -> set[bytes]:
        """The chained keys a subscriber that applied every change so far holds for ``tier``."""
        bit = 1 << int(tier)
        return {k for k, (_, mask) in self.announced.items() if mask & bit}


class ObservedMap(dict):
    """A residency map (key -> block) that reports keys added and removed to a log."""

    __slots__ = ("log", "tier")

    def __init__(self, data, log: ResidencyLog, tier: Tier) -> None:
        super().__init__(data)
        self.log, self.tier = log, tier
        for k in self:
            log.add(tier, k)

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self.log.add(self.tier, key)
        dict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        dict.__delitem__(self, key)
        self.log.remove(self.tier, key)

    def setdefault(self, key, default=None):
        if key not in self:
            self.log.add(self.tier, key)
        return dict.setdefault(self, key, default)

    def pop(self, key, *default):
        if key in self:
            self.log.remove(self.tier, key)
        return dict.pop(self, key, *default)

    def popitem(self):
        k, v = dict.popitem(self)
        self.log.remove(self.tier, k)
        return k, v

    def clear(self) -> None:
        for k in self:
            self.log.remove(self.tier, k)
        dict.clear(self)

    def update(self, *args, **kw) -> None:
        for k, v in dict(*args, **kw).items():
            self[k] = v


class ObservedOrderedMap(OrderedDict):
    """``ObservedMap`` for the storage tier's insertion-ordered key set."""

    def __init__(self, data, log: ResidencyLog, tier: Tier) -> None:
        self.log, self.tier = log, tier
        super().__init__(data)  # through __setitem__: each key counts as added

    def __setitem__(self, key, value) -> None:
        if key not in self:
            self.log.add(self.tier, key)
        OrderedDict.__setitem__(self, key, value)

    def __delitem__(self, key) -> None:
        OrderedDict.__delitem__(self, key)
        self.log.remove(self.tier, key)

    def pop(self, key, *default):
        if key in self:
            self.log.remove(self.tier, key)
        return OrderedDict.pop(self, key, *default)

    def popitem(self, last: bool = True):
        k, v = OrderedDict.popitem(self, last)
        self.log.remove(self.tier, k)
        return k, v

    def clear(self) -> None:
        for k in self:
            self.log.remove(self.tier, k)
        OrderedDict.clear(self)


class GroupedResidency:
    """A hybrid layout's residency: one ``ResidencyLog`` per KV cache group, watching that group's
    device pool (the only tier a hybrid has), each change tagged with its group. Speaks the
    log's calls the cache and ``KVEvents`` make (``register``, ``cleared``, ``take``)."""

    def __init__(self, groups) -> None:
        self.logs: list[tuple[GroupTag, ResidencyLog]] = []
        for gp in groups:  # fastkv.cache.groups.GroupPool
            log = ResidencyLog()
            gp.pool.lookup = ObservedMap(gp.pool.lookup, log, Tier.DEVICE)
            log.maps = {Tier.DEVICE: gp.pool.lookup}
            log.pending_size = max(log.pending_size, 2 * gp.pool.capacity)
            self.logs.append((GroupTag(gp.index, gp.group.kind, gp.group.window or None), log))

    def register(self, *args, **kwargs) -> None:
        for _, log in self.logs:
            log.register(*args, **kwargs)

    def cleared(self) -> None:
        for _, log in self.logs:
            log.cleared()

    def take(self) -> tuple[int, list[Change]]:
        """(AllBlocksCleared count, every group's changes in group order) since the last take."""
        clears, out = 0, []
        for tag, log in self.logs:
            n, changes = log.take()
            clears = max(clears, n)  # one clear empties every group: cleared() tells each log
            out += [ch._replace(group=tag) for ch in changes]
        return clears, out

    def resident_keys(self) -> dict[str, list[bytes]]:
        """Per ``GPU/<group_idx>``, the chained keys a subscriber that applied every change holds."""
        return {f"GPU/{tag.index}": [k for k in log.maps[Tier.DEVICE] if k in log.announced or k in log.pending]
                for tag, log in self.logs}


def watch(state, log: ResidencyLog) -> ResidencyLog:
    """Make ``state``'s three residency maps report to ``log`` (their keys so far count as added)."""
    state.device.lookup = ObservedMap(state.device.lookup, log, Tier.DEVICE)
    state.host.lookup = ObservedMap(state.host.lookup, log, Tier.HOST)
    state.index.stored = ObservedOrderedMap(state.index.stored, log, Tier.STORAGE)
    log.maps = {Tier.DEVICE: state.device.lookup, Tier.HOST: state.host.lookup, Tier.STORAGE: state.index.stored}
    state.watch(log)
    # keys wait there from admission until computed: room for every block the tiers can take
    log.pending_size = max(log.pending_size, 2 * (state.device.capacity + state.host.capacity))
    return log

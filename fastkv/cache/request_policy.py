"""A request's cache policy: which tiers it may read its prefix from, and whether it may write.

``CachePolicy.of`` takes the public forms (``Engine.add_request(cache=...)``, a workload
line's ``cache``): ``None`` or ``True`` (everything: the default), ``False`` (don't cache:
``{"write": []}``), or ``{"read": [tiers], "write": [tiers]}`` with tiers named ``device``,
``host``, ``storage`` (an omitted key allows every tier).

Reads: admission matches a prompt's chain tier by tier (device, then host, then storage), so
the match stops at the first tier the request may not read: ``read: ["device", "storage"]``
reads the device only. Writes are all or nothing: a block's host and storage copies are made
from the tier above it, after it has left the request (write-back on eviction), so a partial
write set could not be kept once the request is gone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fastkv.cache.write_policy import Tier

TIER_NAMES = ("device", "host", "storage")  # Tier order: how a chain is matched


@dataclass(frozen=True, slots=True)
class CachePolicy:
    read: tuple[Tier, ...] = (Tier.DEVICE, Tier.HOST, Tier.STORAGE)  # in Tier order
    write: bool = True  # False: its blocks are never keyed, copied or stored, and freed uncached

    @property
    def readable(self) -> tuple[Tier, ...]:
        """The tiers a prefix match may use: those read up to the first one not read."""
        out = []
        for tier in Tier:
            if tier not in self.read:
                break
            out.append(tier)
        return tuple(out)

    def may_offload(self) -> bool:
        """An offload writes the request's KV to the host and restores it from there."""
        return self.write and Tier.HOST in self.readable

    def may_store(self) -> bool:
        """A storage-mode preemption writes the request's KV to storage and resumes from it."""
        return self.write and Tier.STORAGE in self.readable

    @classmethod
    def of(cls, value: Any) -> CachePolicy | None:
        """The policy of a public ``cache`` value; None for the default. ValueError naming the
        field and the bad value."""
        if value is None or value is True:
            return None
        if value is False:
            return cls(write=False)
        if not isinstance(value, dict):
            raise ValueError(f"cache must be true, false or {{\"read\": [tiers], \"write\": [tiers]}}, got {value!r}")
        unknown = sorted(set(value) - {"read", "write"})
        if unknown:
            raise ValueError(f"cache has unknown keys {unknown}; the keys are read, write")
        read = _tiers("read", value.get("read", TIER_NAMES))
        write = _tiers("write", value.get("write", TIER_NAMES))
        if write and len(write) != len(TIER_NAMES):
            raise ValueError(f"cache.write {value['write']!r}: a request writes every tier (the default) or none ([])")
        policy = cls(read, bool(write))
        return None if policy == cls() else policy


def _tiers(what: str, names: Any) -> tuple[Tier, ...]:
    if not isinstance(names, list | tuple):
        raise ValueError(f"cache.{what} must be a list of tiers ({', '.join(TIER_NAMES)}), got {names!r}")
    for name in names:
        if name not in TIER_NAMES:
            raise ValueError(f"cache.{what}: unknown tier {name!r}; the tiers are {', '.join(TIER_NAMES)}")
    return tuple(Tier(i) for i, name in enumerate(TIER_NAMES) if name in names)


def reads(policy: CachePolicy | None, tier: Tier) -> bool:
    """Whether a request under ``policy`` (None: the default) may have prefix hits in ``tier``."""
    return policy is None or tier in policy.readable

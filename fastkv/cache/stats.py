"""Hit and copy counters of a cache manager. Plain integers bumped on the hot path."""
from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(slots=True)
class CacheStats:
    requests: int = 0  # allocations (prefix lookups that count toward hit ratios)
    prompt_tokens: int = 0
    prompt_blocks: int = 0  # full blocks looked up
    # Tokens served from each tier: device hits at lookup, host and storage hits once their
    # copies landed (a planned hit whose copy fails is recomputed, not served).
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    storage_hit_tokens: int = 0
    storage_lost_tokens: int = 0  # planned storage hits whose LOAD failed: recomputed because of storage
    device_evictions: int = 0  # device blocks evicted (moved to host or dropped)
    host_evictions: int = 0
    unstored_host_evictions: int = 0  # host evictions of blocks the storage tier does not hold
    dropped_keys: int = 0  # keys that left every tier
    inserted_blocks: int = 0
    duplicate_blocks: int = 0  # computed blocks whose key another block already held
    swap_out_blocks: int = 0
    swap_in_blocks: int = 0
    store_blocks: int = 0
    load_blocks: int = 0
    joined_load_blocks: int = 0  # blocks an admission took from another's LOAD in flight (coalesce.py)
    failed_copies: int = 0  # plans completed with ok=False
    load_misses: int = 0  # blocks of failed LOADs
    skipped_copies: int = 0  # host copies not made when due: no host block free
    skipped_stores: int = 0  # blocks a write policy would store, skipped: storage was behind (storage_writes.py)
    late_copies: int = 0  # skipped write-throughs made later, once host blocks were free
    chain_spills: int = 0  # running requests' chain holds let go of for want of host room (tiering.make_host_room)
    offloads: int = 0
    restores: int = 0

    @property
    def hit_tokens(self) -> int:
        return self.device_hit_tokens + self.host_hit_tokens + self.storage_hit_tokens

    def hit_ratio(self, tier: str | None = None) -> float:
        """Prompt-token hit ratio, overall or of one tier ("device", "host", "storage")."""
        hits = self.hit_tokens if tier is None else getattr(self, f"{tier}_hit_tokens")
        return hits / self.prompt_tokens if self.prompt_tokens else 0.0

    def snapshot(self) -> dict[str, float]:
        out: dict[str, float] = asdict(self)
        out.update(hit_ratio=self.hit_ratio(), device_hit_ratio=self.hit_ratio("device"),
                   host_hit_ratio=self.hit_ratio("host"), storage_hit_ratio=self.hit_ratio("storage"))
        return out

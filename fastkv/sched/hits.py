"""Cost-aware hits: load a host or storage hit only where the copy beats recomputing it.

A hit is not always worth its copy: over a slow link (a pool behind 10 GbE) a block's KV takes
longer to arrive than the GPU takes to compute it again. At admission, per request and tier
(host: a swap-in over the host link; storage: a LOAD over the storage link, then the swap-in),
``auto`` keeps the longest run of hit blocks whose copy, queued behind the copies already on
that link, finishes no later than recomputing those tokens would; the rest of the prompt is
recomputed. The prefill already queued on the GPU is left out: it would race a GPU time the
model knows against a copy time it underestimates (a LOAD also reads, checks and stages), and a
load that loses that race delays its request most. A storage run follows the host run, so a
host run cut short drops the storage hits too. ``load`` keeps every hit (the engine's
behaviour without a cost to judge by), ``recompute`` none (so the engine asks storage nothing:
``loads_any``). Recomputed KV is the KV the hit
held (same tokens, same weights: the keys say so), so outputs never depend on the policy.

The costs are the synthetic runner's cost model (``HitCosts.of``), each copy's at least what
the engine measured of that kind of copy (``observe``: a LOAD also reads, checks and stages
the value, which a link's bandwidth leaves out); without a cost model ``auto`` loads.
What is decided here is only a prefix hit at admission: an offloaded request's restore always
copies its own KV back (its partial block and generated tokens have no key another request
could load), and a prefill handoff's decode side always loads. A request preempted in storage
mode is judged like any prompt: recomputing its blocks is exact, and its partial block is loaded
only behind a full run of loaded hits.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

HIT_POLICIES = ("auto", "load", "recompute")
TIERS = ("host", "storage")
MEASURE_ALPHA = 0.2  # weight of a new copy's time in the measured cost per byte


@dataclass(frozen=True, slots=True)
class HitCosts:
    """Seconds on this engine's clock: a block's copy per tier, and prefill compute."""

    block_size: int
    block_bytes: int
    seconds_per_byte: tuple[float, float]  # host tier (swap-in), storage tier (LOAD + swap-in)
    prefill: Callable[[int, int], float]  # seconds to compute positions start..end-1

    @classmethod
    def of(cls, model, block_size: int, block_bytes: int) -> HitCosts:
        """From a ``ScaledCostModel``: its copies are this machine's, its storage link scaled with them."""
        swap = 1.0 / model.copy_bandwidth
        return cls(block_size, block_bytes, (swap, swap + model.storage_seconds(1 << 20) / (1 << 20)),
                   model.prefill_seconds)


@dataclass(slots=True)
class HitStats:
    decisions: int = 0  # admissions that had a host or storage hit to judge
    loaded_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))
    recomputed_tokens: dict[str, int] = field(default_factory=lambda: dict.fromkeys(TIERS, 0))  # by choice
    load_s: float = 0.0  # seconds the copies chosen were judged to take, queues included
    recompute_s: float = 0.0  # modelled seconds of the prefills chosen over a hit

    def to_json(self) -> dict:
        return {"decisions": self.decisions, "loaded_tokens": dict(self.loaded_tokens),
                "recomputed_tokens": dict(self.recomputed_tokens),
                "load_s": round(self.load_s, 6), "recompute_s": round(self.recompute_s, 6)}


class HitPolicy:
    def __init__(self, block_size: int, policy: str = "auto", costs: HitCosts | None = None) -> None:
        if policy not in HIT_POLICIES:
            raise ValueError(f"hit policy must be one of {HIT_POLICIES}, got {policy!r}")
        self.block_size, self.policy, self.costs = block_size, policy, costs
        self.stats = HitStats()
        self.measured = [0.0, 0.0]  # seconds per byte of SWAP_IN and of LOAD tasks here (EWMA; 0: none yet)

    @property
    def loads_any(self) -> bool:
        """False when every hit is recomputed: then storage need not even be asked what it holds."""
        return self.policy != "recompute"

    def observe(self, storage: bool, nbytes: int, seconds: float) -> None:
        """A SWAP_IN or LOAD of ``nbytes`` took ``seconds`` on a rank: the link's cost as it is."""
        m = self.measured
        m[storage] += (MEASURE_ALPHA if m[storage] else 1.0) * (seconds / nbytes - m[storage])

    def seconds_per_byte(self, tier: int) -> float:
        """The modelled cost of a tier's copy, or what it measured if that is more: a LOAD also
        reads, checks and stages the value, which the model's link leaves out."""
        c, m = self.costs, self.measured
        swap = max(c.seconds_per_byte[0], m[0])
        return swap if tier == 0 else swap + max(c.seconds_per_byte[1] - c.seconds_per_byte[0], m[1])

    def to_json(self) -> dict:
        return {"policy": self.policy, "costed": self.costs is not None, **self.stats.to_json()}

    def cut(self, first: int, n_host: int, n_storage: int, queued_blocks: tuple[int, int],
            count: bool = True) -> tuple[int, int]:
        """How many of a prompt's ``n_host`` host hits and the ``n_storage`` storage hits after
        them to load, the hits starting at block ``first``. ``queued_blocks``: blocks already on
        the host and storage links. ``count``: False asks without counting the decision."""
        if not n_host and not n_storage:
            return 0, 0
        st = self.stats if count else HitStats()
        st.decisions += 1
        c = self.costs
        if self.policy == "recompute":
            keep = (0, 0)
        elif self.policy == "load" or c is None:
            keep = (n_host, n_storage)
        else:
            h = self._longest(st, first, n_host, 0, queued_blocks[0])
            s = self._longest(st, first + h, n_storage, 1, queued_blocks[1]) if h == n_host else 0
            keep = (h, s)
        bs = self.block_size
        for tier, n, k in zip(TIERS, (n_host, n_storage), keep, strict=True):
            st.loaded_tokens[tier] += k * bs
            st.recomputed_tokens[tier] += (n - k) * bs
        return keep

    def _longest(self, st: HitStats, first: int, n: int, tier: int, queued: int) -> int:
        """The most blocks from ``first`` whose copy ends no later than their recompute would."""
        c = self.costs
        per_block = c.block_bytes * self.seconds_per_byte(tier)
        for k in range(n, 0, -1):
            load = (queued + k) * per_block
            recompute = c.prefill(first * c.block_size, (first + k) * c.block_size)
            if load <= recompute:
                st.load_s += load
                return k
        if n:
            st.recompute_s += c.prefill(first * c.block_size, (first + n) * c.block_size)
        return 0

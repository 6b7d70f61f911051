"""Per-request sampling parameters: given to ``Engine.add_request``, carried to every worker
rank in the first plan of the request (``PlanMsg.params``), untouched. fastkv samples
nothing: the model does; only ``stop_token_ids`` also end the request on the engine's side.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class Sampling:
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k cut
    seed: int | None = None  # None: the model's own randomness
    stop_token_ids: tuple[int, ...] = ()  # also finish the request (reason "stop") on the engine's side
    extra: dict[str, Any] = field(default_factory=dict)  # anything else the model reads (JSON values)

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not (isinstance(self.temperature, int | float) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"sampling: temperature must be a finite number >= 0, got {self.temperature!r}")
        if not (isinstance(self.top_p, int | float) and 0 < self.top_p <= 1):
            raise ValueError(f"sampling: top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"sampling: top_k must be an int >= 0, got {self.top_k!r}")
        if self.seed is not None and not isinstance(self.seed, int):
            raise ValueError(f"sampling: seed must be an int or None, got {self.seed!r}")
        if any(t < 0 for t in self.stop_token_ids):
            raise ValueError(f"sampling: stop_token_ids must be >= 0, got {list(self.stop_token_ids)}")
        if not isinstance(self.extra, dict):
            raise ValueError(f"sampling: extra must be a dict, got {type(self.extra).__name__}")

    def to_json(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["stop_token_ids"] = list(self.stop_token_ids)
        return doc

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Sampling:
        return cls(**doc)

    @classmethod
    def of(cls, value: Sampling | dict[str, Any] | None) -> Sampling:
        """``value`` as a Sampling (a dict of its fields, or None for the defaults)."""
        if value is None:
            return cls()
        if isinstance(value, Sampling):
            return value
        if not isinstance(value, dict):
            raise TypeError(f"sampling must be a Sampling or a dict, got {type(value).__name__}")
        unknown = set(value) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"sampling: unknown fields {sorted(unknown)}")
        return cls(**value)


def request_params(request_id: str, sampling: Sampling) -> str:
    """A request's entry of ``PlanMsg.params``."""
    return json.dumps({"id": request_id, "sampling": sampling.to_json()}, separators=(",", ":"))

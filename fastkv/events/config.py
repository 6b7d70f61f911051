"""KV event settings (no ZMQ import: a run without events never needs pyzmq or msgspec)."""
from __future__ import annotations

from dataclasses import dataclass

ENCODINGS = ("array", "map")


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV event settings; ``endpoint`` empty (the default) is off."""

    endpoint: str = ""  # tcp://*:5557 binds (also ipc:// and inproc://); tcp://host:5557 connects
    topic: str = "kv@fastkv@fastkv-demo"  # llm-d's subscriber parses kv@<pod id>@<model name>
    replay_endpoint: str = ""  # ROUTER socket for replay requests; empty: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 1_000  # batches ZMQ queues per subscriber on the PUB socket (newer ones are dropped for it)
    encoding: str = "array"  # "array" (llm-d, vLLM's array_like structs) or "map" (tagged maps)
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("endpoint", "topic", "replay_endpoint", "encoding"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv events setting {name!r} must be a string, got {getattr(self, name)!r}")
        for name in ("buffer_steps", "hwm", "data_parallel_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "data_parallel_rank"
                                                                                else 1):
                flag = " (--kv-events-buffer)" if name == "buffer_steps" else ""
                raise ValueError(f"kv events setting {name!r}{flag} must be a positive int, got {value!r}")
        if self.encoding not in ENCODINGS:
            raise ValueError(f"kv events setting 'encoding' must be one of {ENCODINGS}, got {self.encoding!r}")
        if self.replay_endpoint and not self.endpoint:
            raise ValueError("kv events: a replay endpoint needs an endpoint to publish on")

    @property
    def enabled(self) -> bool:
        return bool(self.endpoint)

    def missing_modules(self) -> str:
        """'' when pyzmq and msgspec import, else the one line saying how to get them."""
        try:
            import msgspec  # noqa: F401
            import zmq  # noqa: F401
        except ImportError as exc:
            return f"kv events need {exc.name}: pip install 'fastkv[events]' (pyzmq, msgspec)"
        return ""

"""KV event settings (no ZMQ import: a run without events never needs pyzmq or msgspec)."""
from __future__ import annotations

from dataclasses import dataclass

# wire generations (fastkv.events.schema); the first is the default
SCHEMAS = ("llm-d", "vllm-array", "vllm")
SCHEMES = ("tcp://", "ipc://", "inproc://")
FLAGS = {"endpoint": "--kv-events-endpoint", "replay_endpoint": "--kv-events-replay-endpoint"}


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc:// or inproc:// binds; a host address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


@dataclass(frozen=True, slots=True)
class EventsConfig:
    """KV event settings; ``endpoint`` empty (the default) is off."""

    endpoint: str = ""  # tcp://*:5557 binds (also ipc:// and inproc://); tcp://host:5557 connects
    topic: str = "kv@fastkv@fastkv-demo"  # llm-d's subscriber parses kv@<pod id>@<model name>
    replay_endpoint: str = ""  # ROUTER socket for replay requests; empty: no replay
    buffer_steps: int = 10_000  # batches kept for replay
    hwm: int = 1_000  # batches ZMQ queues per subscriber; a batch one subscriber has no room for is dropped
    stall_timeout_ms: int = 1_000  # a full queue refusing batches this long is set aside, the others get them
    schema: str = SCHEMAS[0]  # the consumer generation the batches are encoded for (docs/KV_EVENTS.md)
    data_parallel_rank: int = 0

    def __post_init__(self) -> None:
        for name in ("endpoint", "topic", "replay_endpoint", "schema"):
            if not isinstance(getattr(self, name), str):
                raise ValueError(f"kv events setting {name!r} must be a string, got {getattr(self, name)!r}")
        for name in ("buffer_steps", "hwm", "stall_timeout_ms", "data_parallel_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < (0 if name == "data_parallel_rank"
                                                                                else 1):
                flag = " (--kv-events-buffer)" if name == "buffer_steps" else ""
                raise ValueError(f"kv events setting {name!r}{flag} must be a positive int, got {value!r}")
        if self.schema not in SCHEMAS:
            raise ValueError(f"kv events setting 'schema' (--kv-events-schema) must be one of {SCHEMAS}, "
                             f"got {self.schema!r}")
        for name, flag in FLAGS.items():
            value = getattr(self, name)
            if value and not value.startswith(SCHEMES):
                raise ValueError(f"{flag} {value!r} is not a ZMQ endpoint (e.g. tcp://*:5557, tcp://HOST:5557, "
                                 "ipc:///tmp/kv-events)")
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

    def check_endpoints(self) -> None:
        """ValueError naming the flag when an endpoint this run binds cannot be bound (busy, no
        such address): checked before anything of the run starts, as the metrics port is."""
        import zmq

        ctx = zmq.Context()
        try:
            for name, flag in FLAGS.items():
                value = getattr(self, name)
                if not value or value.startswith("inproc://") or not (binds(value) or name == "replay_endpoint"):
                    continue
                sock = ctx.socket(zmq.PUB)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    sock.bind(value)
                except zmq.ZMQError as exc:
                    raise ValueError(f"{flag} {value!r}: cannot bind ({exc.strerror})") from None
                finally:
                    sock.close()
        finally:
            ctx.term()

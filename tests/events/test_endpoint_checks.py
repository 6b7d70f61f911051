"""A bad or busy KV-event endpoint is one line naming its flag, before anything of a run starts."""
from __future__ import annotations

import pytest

from fastkv.events.config import EventsConfig


@pytest.mark.parametrize("flag,kwargs", [
    ("--kv-events-endpoint", {"endpoint": "bogus"}),
    ("--kv-events-endpoint", {"endpoint": "127.0.0.1:5557"}),
    ("--kv-events-replay-endpoint", {"endpoint": "tcp://*:5557", "replay_endpoint": "localhost:5558"}),
])
def test_a_malformed_endpoint_names_its_flag(flag, kwargs):
    with pytest.raises(ValueError, match=f"^{flag} .* is not a ZMQ endpoint"):
        EventsConfig(**kwargs)


def test_a_busy_endpoint_names_its_flag_and_a_free_one_passes():
    import zmq  # the events extra (conftest: skips locally without it, fails in CI)

    ctx = zmq.Context()
    held = ctx.socket(zmq.PUB)
    held.setsockopt(zmq.LINGER, 0)
    port = held.bind_to_random_port("tcp://127.0.0.1")
    try:
        with pytest.raises(ValueError, match="^--kv-events-replay-endpoint .*cannot bind"):
            EventsConfig(endpoint="tcp://*:0", replay_endpoint=f"tcp://127.0.0.1:{port}").check_endpoints()
        with pytest.raises(ValueError, match="^--kv-events-endpoint .*cannot bind"):
            EventsConfig(endpoint=f"tcp://*:{port}").check_endpoints()
    finally:
        held.close()
        ctx.term()
    EventsConfig(endpoint=f"tcp://127.0.0.1:{port}").check_endpoints()  # connects: nothing to bind
    EventsConfig(endpoint="tcp://*:0").check_endpoints()

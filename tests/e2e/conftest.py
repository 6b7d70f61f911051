"""Fixtures of the end-to-end tests: a redis-server for the storage runs (the storage tests' helper)."""
from __future__ import annotations

import pytest

from tests.storage.conftest import RedisServer


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server.url
    server.kill()


@pytest.fixture(scope="module")
def mooncake_url():
    """A Mooncake pool (master + holder on 127.0.0.1) for a module's runs; each run gives a
    fresh key prefix where it must not see another's blocks."""
    from tests.storage.conftest import require_mooncake

    require_mooncake()
    from fastkv.storage.local_mooncake import LocalMooncake

    with LocalMooncake(segment_size=512 << 20, lease_ttl_ms=1000) as pool:
        yield pool.url

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

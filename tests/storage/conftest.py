"""Fixtures for the storage tests: real redis-server processes, real Mooncake pools
(mooncake_master plus a holder process) and small KV layouts.

``redis-server`` or the Mooncake client missing: tests/optional.py's rule, skip locally, fail
under CI.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.storage import mooncake_store
from fastkv.storage.base import namespace_fingerprint
from fastkv.storage.local_mooncake import LocalMooncake
from fastkv.storage.local_redis import LocalRedis
from tests.optional import MOONCAKE, REDIS, missing, require_binary

# 2 layers x K/V x 2 heads x 4 tokens x 8 dims x bf16 = 512 bytes per block: fast examples.
SMALL = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16")
NS = namespace_fingerprint("model-a", "weights-1", SMALL.describe())
NS_OTHER = namespace_fingerprint("model-b", "weights-1", SMALL.describe())


def require_redis() -> str:
    return require_binary("redis-server", REDIS)


class RedisServer(LocalRedis):
    """A ``LocalRedis`` that skips the test (locally) or fails it (CI) when redis-server is missing."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        super().__init__(workdir, password, binary=require_redis())


def require_mooncake() -> None:
    if not mooncake_store.AVAILABLE:
        missing("the Mooncake client", MOONCAKE)


@pytest.fixture(scope="session")
def shared_mooncake():
    """One pool (master + holder) for the tests that do not kill it (each uses fresh random keys)."""
    require_mooncake()
    with LocalMooncake(segment_size=256 << 20) as pool:
        yield pool


@pytest.fixture
def mooncake_pool():
    """A pool of this test's own, for tests that kill its master or holder."""
    require_mooncake()
    pool = LocalMooncake(segment_size=64 << 20)
    pool.start()
    yield pool
    pool.stop()


@pytest.fixture(scope="session")
def shared_redis(tmp_path_factory):
    """One server for the tests that do not kill it (each uses fresh random keys)."""
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.kill()


@pytest.fixture
def redis_server(tmp_path):
    """A server of this test's own, for tests that kill or stop it."""
    server = RedisServer(tmp_path)
    server.start()
    yield server
    if server.proc is not None:
        server.resume()  # a SIGSTOPped server must be continued to be waited for after SIGKILL
    server.kill()


def random_host(num_blocks: int, seed: int, layout: KVLayout = SMALL) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.integers(0, 1 << 16, size=layout.host_shape(num_blocks), dtype=np.uint16)


def rand_keys(n: int) -> list[bytes]:
    return [os.urandom(32) for _ in range(n)]

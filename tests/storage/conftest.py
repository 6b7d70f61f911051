"""Fixtures for the storage tests: real redis-server processes and small KV layouts.

``redis-server`` missing: the Redis tests skip locally, but FAIL when CI is set (CI
installs it, so a skip there would hide a broken setup).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import numpy as np
import pytest
import redis

from fastkv.config import KVLayout
from fastkv.storage.base import namespace_fingerprint

REDIS_BIN = shutil.which("redis-server")
# 2 layers x K/V x 2 heads x 4 tokens x 8 dims x bf16 = 512 bytes per block: fast examples.
SMALL = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16")
NS = namespace_fingerprint("model-a", "weights-1", SMALL.describe())
NS_OTHER = namespace_fingerprint("model-b", "weights-1", SMALL.describe())


def require_redis() -> str:
    if REDIS_BIN is None:
        if os.environ.get("CI"):
            pytest.fail("redis-server is not installed, but CI is set: .ci/run must install it")
        pytest.skip("redis-server is not installed")
    return REDIS_BIN


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server on 127.0.0.1 that a test can kill, stop and restart on the same port."""

    def __init__(self, workdir: Path, password: str | None = None) -> None:
        self.binary = require_redis()
        self.workdir = workdir
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert self.proc is None, "redis-server already running"
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir), "--logfile", str(self.workdir / "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, password=self.password, socket_timeout=0.5, socket_connect_timeout=0.5)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.RedisError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    log = (self.workdir / "redis.log").read_text() if (self.workdir / "redis.log").exists() else ""
                    self.kill()
                    raise RuntimeError(f"redis-server on port {self.port} did not start:\n{log[-2000:]}") from None
                time.sleep(0.02)
            finally:
                client.close()

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=self.password, socket_timeout=2)


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

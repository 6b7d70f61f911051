"""Redis specifics against real redis-server processes: the server killed (SIGKILL) or
frozen (SIGSTOP) mid-run and brought back, passwords, and URL configuration."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from fastkv.storage import open_store
from fastkv.storage.redis_store import RedisStore

from .conftest import NS, RedisServer, rand_keys, random_host

pytestmark = pytest.mark.redis

TIMEOUT = 0.5
BACKOFF = 0.2
MAX_BACKOFF = 0.4
# An operation never takes longer than one socket timeout (plus scheduling slack on a busy CI box).
OP_BOUND = TIMEOUT + 0.5


def fast_failing(url: str) -> RedisStore:
    return open_store(f"{url}?timeout={TIMEOUT}&backoff={BACKOFF}&max_backoff={MAX_BACKOFF}", NS)


def wait_for_recovery(store: RedisStore, host, bound: float) -> float:
    """Seconds until a put + get round trip works again; fails the test after ``bound``."""
    t0 = time.monotonic()
    keys = rand_keys(2)
    out = np.zeros_like(host)
    while time.monotonic() - t0 < bound:
        if store.put(keys, host, [0, 1]) == [True, True] and store.get(keys, out, [0, 1]) == [True, True]:
            assert np.array_equal(out, host[:2])
            return time.monotonic() - t0
        time.sleep(0.02)
    pytest.fail(f"the store did not recover within {bound} s of the server's return")


def test_server_killed_mid_run_then_restarted(redis_server):
    """A worker thread loads and stores continuously while the server is SIGKILLed and
    restarted on the same port: no call raises or outlasts its timeout, failed calls are
    misses, and the worker's calls succeed again soon after the restart, by themselves."""
    store = fast_failing(redis_server.url)
    host = random_host(4, seed=0)
    keys = rand_keys(4)
    log: list[tuple[float, float, bool]] = []  # start, duration, every block ok
    stop = threading.Event()
    errors: list[BaseException] = []

    def worker() -> None:
        out = np.zeros_like(host)
        try:
            while not stop.is_set():
                t0 = time.monotonic()
                ok = all(store.put(keys, host, range(4)))
                got = store.get(keys, out, range(4))
                ok = ok and all(got)
                log.append((t0, time.monotonic() - t0, ok))
                if ok:
                    assert np.array_equal(out, host)
                time.sleep(0.005)
        except BaseException as e:  # surfaced to the test below
            errors.append(e)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    time.sleep(0.3)
    redis_server.kill()
    killed_at = time.monotonic()
    time.sleep(1.0)
    restarting_at = time.monotonic()
    redis_server.start()
    restarted_at = time.monotonic()
    time.sleep(1.5)
    stop.set()
    thread.join(10)
    assert not thread.is_alive(), "the worker hung"
    assert not errors, f"an error reached the caller: {errors[0]!r}"
    assert max(d for _, d, _ in log) < 2 * OP_BOUND, "a call outlasted its timeout"
    assert any(ok for t, _, ok in log if t < killed_at), "no successful call before the kill"
    assert not any(ok for t, d, ok in log if killed_at < t and t + d < restarting_at), "served from a dead server"
    assert any(not ok for t, _, ok in log if killed_at < t < restarting_at)
    recovered = [t for t, _, ok in log if ok and t > restarted_at]
    assert recovered, "never recovered after the restart"
    assert recovered[0] - restarted_at < MAX_BACKOFF + OP_BOUND
    assert store.stats.errors >= 1 and store.skipped >= 1
    store.close()


def test_dead_server_calls_return_within_timeout(redis_server):
    store = fast_failing(redis_server.url)
    host = random_host(2, seed=1)
    keys = rand_keys(2)
    assert store.put(keys, host, [0, 1]) == [True, True]
    redis_server.kill()
    out = np.zeros_like(host)
    for call in (lambda: store.get(keys, out, [0, 1]), lambda: store.put(keys, host, [0, 1]),
                 lambda: store.exists(keys), lambda: store.delete(keys)):
        t0 = time.monotonic()
        result = call()
        assert time.monotonic() - t0 < OP_BOUND
        assert result in ([False, False], None)
    assert not out.any(), "a failed get wrote into the host"
    assert store.stats.errors >= 1
    redis_server.start()
    wait_for_recovery(store, host, bound=MAX_BACKOFF + 2 * OP_BOUND)
    # The restarted server kept nothing (no persistence): old blocks are plain misses.
    assert store.get(keys, out, [0, 1]) == [False, False]
    store.close()


def test_frozen_server_times_out_then_recovers(redis_server):
    """SIGSTOP: the server accepts connections but never answers (a hung or overloaded server)."""
    store = fast_failing(redis_server.url)
    host = random_host(2, seed=2)
    keys = rand_keys(2)
    assert store.put(keys, host, [0, 1]) == [True, True]
    redis_server.pause()
    out = np.zeros_like(host)
    t0 = time.monotonic()
    assert store.get(keys, out, [0, 1]) == [False, False]
    elapsed = time.monotonic() - t0
    assert elapsed < OP_BOUND, f"get took {elapsed:.2f}s against a frozen server"
    t0 = time.monotonic()
    assert store.put(keys, host, [0, 1]) == [False, False]  # inside the backoff: no network wait
    assert time.monotonic() - t0 < 0.1
    redis_server.resume()
    wait_for_recovery(store, host, bound=MAX_BACKOFF + 2 * OP_BOUND)
    assert store.get(keys, out, [0, 1]) == [True, True]
    assert np.array_equal(out, host)
    store.close()


def test_server_down_at_start_is_picked_up_later(tmp_path):
    server = RedisServer(tmp_path)  # not started yet
    store = fast_failing(server.url)
    host = random_host(2, seed=3)
    assert store.put(rand_keys(2), host, [0, 1]) == [False, False]
    server.start()
    try:
        wait_for_recovery(store, host, bound=MAX_BACKOFF + 2 * OP_BOUND)
    finally:
        store.close()
        server.kill()


def test_password(tmp_path):
    server = RedisServer(tmp_path, password="s3cret")
    server.start()
    try:
        host = random_host(2, seed=4)
        keys = rand_keys(2)
        good = fast_failing(server.url)
        assert good.put(keys, host, [0, 1]) == [True, True]
        out = np.zeros_like(host)
        assert good.get(keys, out, [0, 1]) == [True, True] and np.array_equal(out, host)
        url_no_auth = f"redis://127.0.0.1:{server.port}/0"
        url_bad_auth = f"redis://:wrong@127.0.0.1:{server.port}/0"
        for url in (url_no_auth, url_bad_auth):
            bad = fast_failing(url)
            out[:] = 0
            assert bad.get(keys, out, [0, 1]) == [False, False]
            assert bad.put(keys, host, [0, 1]) == [False, False]
            assert bad.stats.errors == 1 and not out.any()
            bad.close()
        good.close()
    finally:
        server.kill()


def test_url_options(shared_redis):
    store = open_store(f"{shared_redis.url}?timeout=0.25&backoff=0.1&max_backoff=2&ttl=60&prefix=t1"
                       "&max_batch_bytes=1K", NS, 1, 2)
    assert (store.timeout, store.backoff, store.max_backoff, store.ttl) == (0.25, 0.1, 2.0, 60)
    host = random_host(5, seed=5)
    keys = rand_keys(5)
    assert store.put(keys, host, range(5)) == [True] * 5  # 1 KiB per pipeline: five pipelines
    client = shared_redis.client()
    rkey = f"t1:{keys[0].hex()}:1".encode()
    assert 0 < client.ttl(rkey) <= 60
    client.close()
    out = np.zeros_like(host)
    assert store.get(keys, out, range(5)) == [True] * 5 and np.array_equal(out, host)
    store.close()
    with pytest.raises(ValueError, match="unknown option 'timout'"):
        open_store(f"{shared_redis.url}?timout=1", NS)
    with pytest.raises(ValueError, match="timeout"):
        open_store(f"{shared_redis.url}?timeout=0", NS)

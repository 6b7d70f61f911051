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
# An operation waits at most one socket timeout. The bound is ten times that, so that it holds
# while a loaded 2-core machine keeps the thread off a core, and still fails a call that waits
# for the server (a frozen server never answers) or retries instead of giving up.
OP_BOUND = 10 * TIMEOUT
EVENT_WAIT = 30.0  # the worker thread reaches each phase (a loaded machine may starve it)


def fast_failing(url: str, backoff: float = BACKOFF, max_backoff: float = MAX_BACKOFF) -> RedisStore:
    return open_store(f"{url}?timeout={TIMEOUT}&backoff={backoff}&max_backoff={max_backoff}", NS)


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
    misses, and the worker's calls succeed again after the restart, by themselves. Each
    phase waits for the worker's calls (events), not for a fixed time."""
    store = fast_failing(redis_server.url)
    host = random_host(4, seed=0)
    keys = rand_keys(4)
    log: list[tuple[float, float, bool]] = []  # start, duration, every block ok
    stop = threading.Event()
    errors: list[BaseException] = []
    killed_at = restarted_at = float("inf")
    served, failed, recovered = threading.Event(), threading.Event(), threading.Event()

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
                if ok and t0 < killed_at:
                    served.set()
                elif not ok and t0 > killed_at:
                    failed.set()
                if ok and t0 > restarted_at:
                    recovered.set()
                time.sleep(0.005)
        except BaseException as e:  # surfaced to the test below
            errors.append(e)

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    assert served.wait(EVENT_WAIT), "no successful call before the kill"
    redis_server.kill()
    killed_at = time.monotonic()
    assert failed.wait(EVENT_WAIT), "no call failed while the server was dead"
    restarting_at = time.monotonic()
    redis_server.start()
    restarted_at = time.monotonic()
    assert recovered.wait(EVENT_WAIT), "never recovered after the restart"
    stop.set()
    thread.join(EVENT_WAIT)
    assert not thread.is_alive(), "the worker hung"
    assert not errors, f"an error reached the caller: {errors[0]!r}"
    assert max(d for _, d, _ in log) < OP_BOUND, "a call outlasted its timeout"
    assert not any(ok for t, d, ok in log if killed_at < t and t + d < restarting_at), "served from a dead server"
    assert store.stats.errors >= 1 and store.stats.skipped >= 1
    store.close()


def test_dead_server_calls_return_within_timeout(redis_server):
    store = fast_failing(redis_server.url)
    host = random_host(2, seed=1)
    keys = rand_keys(2)
    assert store.put(keys, host, [0, 1]) == [True, True]
    redis_server.kill()
    out = np.zeros_like(host)
    calls = {"get": (lambda: store.get(keys, out, [0, 1]), [False, False]),
             "put": (lambda: store.put(keys, host, [0, 1]), [False, False]),
             "exists": (lambda: store.exists(keys), [False, False]), "delete": (lambda: store.delete(keys), None)}
    for name, (call, want) in calls.items():
        t0 = time.monotonic()
        result = call()
        assert time.monotonic() - t0 < OP_BOUND, name
        assert result == want, f"{name} -> {result!r}"
    assert not out.any(), "a failed get wrote into the host"
    assert store.stats.errors >= 1
    assert store.stats.errors + store.stats.skipped == len(calls), "each call failed or was skipped, once"
    redis_server.start()
    wait_for_recovery(store, host, bound=MAX_BACKOFF + 2 * OP_BOUND)
    # The restarted server kept nothing (no persistence): old blocks are plain misses.
    assert store.get(keys, out, [0, 1]) == [False, False]
    store.close()


def test_frozen_server_times_out_then_recovers(redis_server):
    """SIGSTOP: the server accepts connections but never answers (a hung or overloaded server)."""
    backoff = 3.0  # long enough that the put below comes inside it even on a loaded machine
    store = fast_failing(redis_server.url, backoff, backoff)
    host = random_host(2, seed=2)
    keys = rand_keys(2)
    assert store.put(keys, host, [0, 1]) == [True, True]
    redis_server.pause()
    out = np.zeros_like(host)
    t0 = time.monotonic()
    assert store.get(keys, out, [0, 1]) == [False, False]
    elapsed = time.monotonic() - t0
    assert elapsed < OP_BOUND, f"get took {elapsed:.2f}s against a frozen server"
    assert (store.stats.errors, store.stats.skipped) == (1, 0)
    assert store.put(keys, host, [0, 1]) == [False, False]
    assert (store.stats.errors, store.stats.skipped) == (1, 1), "inside the backoff, put went to the server"
    redis_server.resume()
    wait_for_recovery(store, host, bound=backoff + 2 * OP_BOUND)
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

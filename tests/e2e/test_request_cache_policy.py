"""A request's cache policy (``cache=``) through the public API and the supervisor's workload file:
``cache=False`` (``{"write": []}``) leaves no key of the request in any tier once it finished, and
stores nothing in the pool; a read filter without "storage" never asks the pool (no LOOKUP, no
LOAD), while the same request without it is served from there, and neither does an engine whose hit
policy recomputes every hit; a bad tier is refused naming it."""
from __future__ import annotations

import dataclasses

import pytest

from fastkv.engine import Engine, RequestRejected
from tests.e2e.test_request_keys import BS, PROMPT, _hits, _served, _spec

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
FULL = (len(PROMPT) - 1) // BS * BS  # a hit never covers the last prompt token


def _present(engine: Engine) -> set[bytes]:
    cache = engine.cache
    return set(cache.device.lookup) | set(cache.host.lookup) | set(cache.index.stored)


def test_a_request_that_may_not_write_leaves_nothing_and_a_read_filter_never_asks_the_pool(tmp_path):
    store = tmp_path / "pool"

    def first(engine: Engine) -> None:
        stats = engine.cache.stats
        assert _hits(engine, cache=False) == 0  # output checked against a run alone
        mine = engine.cache.keys_for(PROMPT)
        assert not set(mine) & _present(engine) and stats.store_blocks == 0
        assert _hits(engine, cache={"read": ["device"], "write": []}) == 0  # nothing of the first was cached
        assert _hits(engine) == 0 and stats.store_blocks > 0  # the default writes every tier
        assert _hits(engine, cache=False) == FULL  # and one that may not write reads it
        with pytest.raises(RequestRejected, match=r"request 'bad' rejected: cache.read: unknown tier 'gpu'"):
            engine.add_request(PROMPT, 4, request_id="bad", cache={"read": ["gpu"]})

    _served(_spec(tmp_path, store), first)

    def restarted(engine: Engine) -> None:  # only the pool holds the prompt now
        stats, lookups = engine.cache.stats, engine.lookups.stats
        asked = lookups.lookups
        assert _hits(engine, cache={"read": ["device", "host"], "write": []}) == 0  # writes nothing either
        assert lookups.lookups == asked and stats.storage_hit_tokens == 0  # no LOOKUP, no LOAD
        assert _hits(engine) == FULL and stats.storage_hit_tokens == FULL

    _served(_spec(tmp_path, store), restarted)

    def recomputing(engine: Engine) -> None:  # the pool holds the prompt, but nothing it holds is loaded
        stats, lookups = engine.cache.stats, engine.lookups.stats
        assert _hits(engine) == 0 and _hits(engine) == FULL  # recomputed, then a device hit
        assert (lookups.lookups, lookups.keys_asked, stats.storage_hit_tokens) == (0, 0, 0)  # no LOOKUP, no LOAD

    _served(dataclasses.replace(_spec(tmp_path, store), hit_policy="recompute"), recomputing)


def test_a_workload_files_uncached_requests_store_nothing_in_the_pool(tmp_path):
    """Through the engine process the supervisor runs: with every request ``"cache": false`` the
    pool gets nothing and a restart on it finds nothing; the same workload without it stores."""
    from tests.e2e.test_engine_synthetic import run_once, workload

    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    wl = workload(9, 4, ["offload"])
    _, a = run_once(tmp_path, "a", url, [{**w, "cache": False} for w in wl], num_host_blocks=64)
    _, b = run_once(tmp_path, "b", url, wl, num_host_blocks=64)
    assert a["storage_blocks_stored"] == 0 and a["preemptions"].get("offload", 0) == 0, a
    assert b["storage_lookup"]["keys_found"] == 0 and b["storage_blocks_stored"] > 0, b

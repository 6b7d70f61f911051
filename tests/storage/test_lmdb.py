"""LMDB specifics: the byte bound, eviction of whole key families in LRU order (scenario and
reference-model property), and two rank processes sharing one environment."""
from __future__ import annotations

import multiprocessing as mp
from collections import OrderedDict

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastkv.storage.base import HEADER_BYTES
from fastkv.storage.lmdb_store import LMDBStore

from .conftest import NS, SMALL, rand_keys, random_host

VALUE = HEADER_BYTES + SMALL.block_bytes  # bytes one shard occupies in the bound


def two_ranks(path, families: int):
    """Rank 0 and rank 1 of a tp=2 engine, bounded to ``families`` whole families."""
    return [LMDBStore(str(path), NS, r, 2, max_bytes=families * 2 * VALUE) for r in (0, 1)]


def put_family(ranks, key: bytes, host, block: int) -> None:
    for store in ranks:
        assert store.put([key], host, [block]) == [True]


def test_lru_families_are_evicted_whole(tmp_path):
    ranks = two_ranks(tmp_path, families=4)
    host = random_host(1, seed=0)
    f = rand_keys(6)
    for k in f[:4]:
        put_family(ranks, k, host, 0)
    assert ranks[0].families_lru() == f[:4]
    assert ranks[0].used_bytes() == 4 * 2 * VALUE
    out = np.zeros_like(host)
    assert ranks[0].get([f[0]], out, [0]) == [True]  # f0 is now the most recently used
    put_family(ranks, f[4], host, 0)
    assert ranks[0].families_lru() == [f[2], f[3], f[0], f[4]], "f1 (least recently used) should go"
    for store in ranks:
        assert store.exists([f[1]]) == [False], "every rank's shard of the evicted family goes"
        assert store.exists([f[0], f[2], f[3], f[4]]) == [True] * 4
        store.check_integrity()
    # A batch that by itself exceeds the bound keeps its newest part and says which is gone.
    batch = rand_keys(10)  # 10 shards of rank 0, the bound holds 8
    hosts = random_host(10, seed=1)
    got = ranks[0].put(batch, hosts, range(10))
    assert sum(got) == 8 and ranks[0].used_bytes() <= ranks[0].max_bytes
    assert ranks[0].exists(batch) == got
    for store in ranks:
        store.check_integrity()
        store.close()


def test_value_larger_than_the_bound_is_refused(tmp_path):
    store = LMDBStore(str(tmp_path), NS, max_bytes=VALUE - 1)
    host = random_host(1, seed=0)
    assert store.put(rand_keys(1), host, [0]) == [False]
    assert store.stats.store_failed == 1 and store.used_bytes() == 0
    store.close()


def test_closed_store_raises_and_close_is_idempotent(tmp_path):
    store = LMDBStore(str(tmp_path), NS)
    store.close()
    store.close()
    with pytest.raises(ValueError, match="closed"):
        store.exists(rand_keys(1))


def test_data_survives_reopen(tmp_path):
    host = random_host(2, seed=4)
    keys = rand_keys(2)
    with LMDBStore(str(tmp_path), NS) as store:
        assert store.put(keys, host, [0, 1]) == [True, True]
    out = np.zeros_like(host)
    with LMDBStore(str(tmp_path), NS) as store:
        assert store.get(keys, out, [0, 1]) == [True, True]
        store.check_integrity()
    assert np.array_equal(out, host)


lru_op = st.tuples(st.sampled_from(["put", "get", "delete"]), st.integers(0, 1), st.integers(0, 7))


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ops=st.lists(lru_op, min_size=1, max_size=40))
def test_eviction_matches_an_lru_reference_model(tmp_path_factory, ops):
    """Single-key operations by two ranks against an OrderedDict of families."""
    ranks = two_ranks(tmp_path_factory.mktemp("lru"), families=3)
    keys = rand_keys(8)
    host = random_host(1, seed=2)
    out = np.zeros_like(host)
    model: OrderedDict[int, set[int]] = OrderedDict()  # family -> ranks holding a shard, LRU first
    bound = ranks[0].max_bytes
    for kind, rank, fam in ops:
        store = ranks[rank]
        if kind == "put":
            assert store.put([keys[fam]], host, [0]) == [True]
            model.setdefault(fam, set()).add(rank)
            model.move_to_end(fam)
            while sum(len(r) for r in model.values()) * VALUE > bound:
                model.popitem(last=False)  # the whole family, all ranks
        elif kind == "get":
            hit = fam in model and rank in model[fam]
            assert store.get([keys[fam]], out, [0]) == [hit]
            if hit:
                model.move_to_end(fam)
        else:
            store.delete([keys[fam]])
            if fam in model:
                model[fam].discard(rank)
                if not model[fam]:
                    del model[fam]
        for s in ranks:
            s.flush()  # pending access ticks into the LRU record before comparing
        assert ranks[0].families_lru() == [keys[f] for f in model]
        for r, s in enumerate(ranks):
            assert s.exists(keys) == [f in model and r in model[f] for f in range(8)]
            s.check_integrity()
    for s in ranks:
        s.close()


def _rank_worker(path: str, rank: int, keys: list[bytes], rounds: int, conn) -> None:
    try:
        conn.send(_rank_work(path, rank, keys, rounds))
    except BaseException as e:
        conn.send(repr(e))
        raise
    finally:
        conn.close()


def _rank_work(path: str, rank: int, keys: list[bytes], rounds: int):
    """One transfer process: stores and loads its shards; checks every hit's bytes."""
    store = LMDBStore(path, NS, rank, 2, max_bytes=24 * 2 * VALUE)
    rng = np.random.default_rng(rank)
    host = np.zeros(SMALL.host_shape(8), np.uint16)
    hits = bad = 0
    for _ in range(rounds):
        idx = rng.choice(len(keys), 8, replace=False)
        if rng.random() < 0.5:
            for slot, i in enumerate(idx):
                host[slot] = expected_block(keys[i], rank)
            ok = store.put([keys[i] for i in idx], host, range(8))
            assert all(ok), f"put failed under contention: {ok} {store.stats}"
        else:
            host[:] = 0
            got = store.get([keys[i] for i in idx], host, range(8))
            for slot, (i, hit) in enumerate(zip(idx, got, strict=True)):
                if hit:
                    hits += 1
                    bad += not np.array_equal(host[slot], expected_block(keys[i], rank))
    store.close()
    return hits, bad, store.stats.corrupt, store.stats.errors


def expected_block(key: bytes, rank: int) -> np.ndarray:
    rng = np.random.default_rng([int.from_bytes(key[:8], "little"), rank])
    return rng.integers(0, 1 << 16, SMALL.host_shape(1)[1:], dtype=np.uint16)


def test_two_rank_processes_share_one_environment(tmp_path):
    keys = rand_keys(40)  # more families than fit (24): eviction runs concurrently with loads
    ctx = mp.get_context("spawn")
    procs, pipes = [], []
    for rank in (0, 1):
        parent, child = ctx.Pipe(duplex=False)
        p = ctx.Process(target=_rank_worker, args=(str(tmp_path), rank, keys, 300, child))
        p.start()
        procs.append(p)
        pipes.append(parent)
    results = []
    for p, conn in zip(procs, pipes, strict=True):
        assert conn.poll(120), f"rank process {p.pid} did not finish in 120 s"
        results.append(conn.recv())
        p.join(10)
        assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
    for result in results:
        assert isinstance(result, tuple), f"a rank process failed: {result}"
        hits, bad, corrupt, errors = result
        assert bad == 0 and corrupt == 0 and errors == 0, results
        assert hits > 0, results
    with LMDBStore(str(tmp_path), NS, 0, 2, max_bytes=24 * 2 * VALUE) as store:
        store.check_integrity()
        assert store.used_bytes() <= store.max_bytes

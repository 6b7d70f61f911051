"""Behaviour every backend shares, against real LMDB environments, real redis-servers and a
real Mooncake pool:
round trips against a dict reference model, 100% detection of corrupted or foreign values,
namespace isolation between engines sharing one pool, and input validation."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastkv.storage import open_store
from fastkv.storage.base import HEADER_BYTES, ValueCodec
from fastkv.storage.lmdb_store import LMDBStore
from fastkv.storage.mooncake_store import MooncakeStore

from .conftest import NS, NS_OTHER, SMALL, rand_keys, random_host

NUM_BLOCKS = 8
fixture_ok = settings(suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(params=["lmdb", pytest.param("redis", marks=pytest.mark.redis),
                        pytest.param("mooncake", marks=pytest.mark.mooncake)])
def make_store(request, tmp_path):
    """``make_store(namespace=NS, rank=0, tp_size=1)``: backends of one pool (one LMDB dir / one server)."""
    opened = []

    def make(namespace: bytes = NS, rank: int = 0, tp_size: int = 1):
        if request.param == "lmdb":
            url = f"lmdb://{tmp_path}/env?max_bytes=64M"
        elif request.param == "redis":
            url = request.getfixturevalue("shared_redis").url + "?timeout=2"
        else:
            url = request.getfixturevalue("shared_mooncake").url
        store = open_store(url, namespace, rank, tp_size)
        opened.append(store)
        return store

    yield make
    for store in opened:  # every test ends with consistent LMDB accounting
        if isinstance(store, LMDBStore):
            store.check_integrity()
        store.close()


@pytest.fixture
def store(make_store):
    return make_store()


def integrity(store) -> None:
    if isinstance(store, LMDBStore):
        store.check_integrity()


def test_put_get_round_trip_is_byte_identical(store):
    host = random_host(NUM_BLOCKS, seed=1)
    keys = rand_keys(NUM_BLOCKS)
    assert store.exists(keys) == [False] * NUM_BLOCKS
    assert store.put(keys, host, np.arange(NUM_BLOCKS)) == [True] * NUM_BLOCKS
    assert store.exists(keys) == [True] * NUM_BLOCKS
    out = np.zeros_like(host)
    order = np.arange(NUM_BLOCKS)[::-1].copy()  # load into other slots than stored from
    assert store.get(keys, out, order) == [True] * NUM_BLOCKS
    assert np.array_equal(out[order], host)
    s = store.stats
    assert (s.hits, s.misses, s.corrupt, s.errors, s.stored) == (NUM_BLOCKS, 0, 0, 0, NUM_BLOCKS)
    assert s.bytes_read == s.bytes_written == NUM_BLOCKS * SMALL.block_bytes
    store.delete(keys[:3])
    assert store.exists(keys) == [False] * 3 + [True] * (NUM_BLOCKS - 3)


def test_empty_batches(store):
    host = random_host(2, seed=0)
    assert store.put([], host, []) == []
    assert store.get([], host, []) == []
    assert store.exists([]) == []
    store.delete([])


op = st.one_of(
    st.tuples(st.just("put"), st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
              st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=4, max_size=4), st.integers(0, 2**32 - 1)),
    st.tuples(st.just("get"), st.lists(st.integers(0, 5), min_size=1, max_size=4, unique=True),
              st.lists(st.integers(0, NUM_BLOCKS - 1), min_size=4, max_size=4)),
    st.tuples(st.just("delete"), st.lists(st.integers(0, 5), max_size=3)),
)


@fixture_ok
@given(ops=st.lists(op, min_size=1, max_size=12))
def test_matches_a_dict_reference_model(store, ops):
    keys = rand_keys(6)  # fresh keys per example: examples share the pool
    model: dict[int, bytes] = {}
    for step in ops:
        if step[0] == "put":
            _, kidx, ids, seed = step
            host = random_host(NUM_BLOCKS, seed)
            ids = ids[: len(kidx)]
            assert store.put([keys[i] for i in kidx], host, ids) == [True] * len(kidx)
            for i, b in zip(kidx, ids, strict=False):
                if store.overwrites or i not in model:  # else the stored value stays (base.py)
                    model[i] = host[b].tobytes()
        elif step[0] == "get":
            _, kidx, ids = step
            ids = ids[: len(kidx)]
            out = random_host(NUM_BLOCKS, seed=7)
            expect = out.copy()
            for i, b in zip(kidx, ids, strict=False):
                if i in model:
                    expect[b] = np.frombuffer(model[i], np.uint16).reshape(expect[b].shape)
            got = store.get([keys[i] for i in kidx], out, ids)
            assert got == [i in model for i in kidx]
            assert np.array_equal(out, expect), "a loaded block differs, or a missed block was written"
        else:
            _, kidx = step
            store.delete([keys[i] for i in kidx])
            for i in kidx:
                model.pop(i, None)
        assert store.exists(keys) == [i in model for i in range(6)]
        integrity(store)


# --- corruption: every mutation of a stored value is a miss, counted, deleted -----------

def _stored(store):
    host = random_host(1, seed=3)
    key = rand_keys(1)
    assert store.put(key, host, [0]) == [True]
    value = store.get_raw(key[0])
    assert value is not None and len(value) == HEADER_BYTES + SMALL.block_bytes
    return key, value


def _assert_rejected(store, key, corrupt_before: int) -> None:
    out = random_host(1, seed=9)
    before = out.copy()
    assert store.get(key, out, [0]) == [False]
    if not store.lands_in_place:  # one that does leaves it unkeyed: the cache never reads it
        assert np.array_equal(out, before), "a corrupt value reached the host block"
    assert store.stats.corrupt == corrupt_before + 1
    assert store.exists(key) == [False], "a corrupt value was not deleted"
    integrity(store)


@fixture_ok
@given(data=st.data())
def test_flipped_bytes_anywhere_are_detected(store, data):
    key, value = _stored(store)
    pos = data.draw(st.integers(0, len(value) - 1), label="position")
    mask = data.draw(st.integers(1, 255), label="xor")
    bad = bytearray(value)
    bad[pos] ^= mask
    store.put_raw(key[0], bytes(bad))
    _assert_rejected(store, key, store.stats.corrupt)


@fixture_ok
@given(data=st.data())
def test_truncated_or_extended_values_are_detected(store, data):
    key, value = _stored(store)
    if data.draw(st.booleans(), label="truncate"):
        shortest = 1 if isinstance(store, MooncakeStore) else 0  # Mooncake stores no empty values
        bad = value[: data.draw(st.integers(shortest, len(value) - 1), label="length")]
    else:
        bad = value + data.draw(st.binary(min_size=1, max_size=64), label="tail")
    store.put_raw(key[0], bad)
    _assert_rejected(store, key, store.stats.corrupt)


@pytest.mark.parametrize("foreign", ["namespace", "key", "rank", "tp_size", "version", "magic", "payload_size"])
def test_well_formed_foreign_values_are_detected(store, foreign):
    """Values with a valid checksum that belong to someone else are misses too."""
    key, value = _stored(store)
    payload = memoryview(value)[HEADER_BYTES:]
    if foreign == "namespace":
        bad = ValueCodec(NS_OTHER, 0, 1).header(key[0], payload) + payload
    elif foreign == "key":
        bad = ValueCodec(NS, 0, 1).header(rand_keys(1)[0], payload) + payload
    elif foreign == "rank":
        bad = ValueCodec(NS, 1, 2).header(key[0], payload) + payload
    elif foreign == "tp_size":
        bad = ValueCodec(NS, 0, 2).header(key[0], payload) + payload
    elif foreign == "payload_size":
        short = payload[:-2]
        bad = ValueCodec(NS, 0, 1).header(key[0], short) + short
    elif foreign == "magic":
        bad = b"XXXX" + value[4:]
    else:
        bad = value[:4] + (99).to_bytes(2, "little") + value[6:]
    store.put_raw(key[0], bad)
    _assert_rejected(store, key, store.stats.corrupt)


@pytest.mark.parametrize("garbage", [b"", b"\0"])
def test_garbage_value_is_a_miss(store, garbage):
    key, _ = _stored(store)
    if not garbage and isinstance(store, MooncakeStore):
        with pytest.raises(ValueError, match="no empty values"):
            store.put_raw(key[0], garbage)
        return
    store.put_raw(key[0], garbage)
    _assert_rejected(store, key, 0)


# --- several engines / ranks on one pool ---------------------------------------------

def test_engines_share_blocks_only_within_a_namespace(make_store):
    a, b, c = make_store(NS), make_store(NS), make_store(NS_OTHER)
    host = random_host(4, seed=5)
    keys = rand_keys(4)
    assert a.put(keys, host, range(4)) == [True] * 4
    out = np.zeros_like(host)
    assert b.get(keys, out, range(4)) == [True] * 4, "same namespace must hit"
    assert np.array_equal(out, host)
    # Engine c's own keys chain its namespace, so they differ: a plain miss.
    other_keys = rand_keys(4)
    assert c.get(other_keys, out, range(4)) == [False] * 4
    # Even a colliding key never serves a foreign namespace's bytes.
    out2 = np.zeros_like(host)
    assert c.get(keys[:2], out2, range(2)) == [False, False]
    assert c.lands_in_place or not out2.any()  # one that does leaves them unkeyed: the cache never reads them
    assert c.stats.corrupt == 2 and c.stats.hits == 0
    assert b.get(keys[2:], out, range(2, 4)) == [True, True]


def test_ranks_have_separate_shards(make_store):
    r0, r1 = make_store(NS, 0, 2), make_store(NS, 1, 2)
    h0, h1 = random_host(2, seed=10), random_host(2, seed=11)
    keys = rand_keys(2)
    assert r0.put(keys, h0, [0, 1]) == [True, True]
    assert r1.exists(keys) == [False, False]
    assert r1.put(keys[:1], h1, [0]) == [True]
    out = np.zeros_like(h0)
    assert r1.get(keys, out, [0, 1]) == [True, False]
    assert np.array_equal(out[0], h1[0])
    assert r0.get(keys, out, [0, 1]) == [True, True]
    assert np.array_equal(out, h0)


# --- bad input ----------------------------------------------------------------------

def test_bad_input_raises(make_store, store):
    host = random_host(4, seed=0)
    key = rand_keys(1)
    with pytest.raises(ValueError, match="32 bytes"):
        store.put([b"short"], host, [0])
    with pytest.raises(ValueError, match="out of range"):
        store.get(key, host, [4])
    with pytest.raises(ValueError, match="one block id per key"):
        store.put(key, host, [0, 1])
    with pytest.raises(TypeError, match="sequence"):
        store.exists(key[0])
    with pytest.raises(ValueError, match="C-contiguous"):
        store.put(key, host[:, ::-1], [0])
    with pytest.raises(TypeError, match="numpy"):
        store.get(key, host.tolist(), [0])
    host.flags.writeable = False
    with pytest.raises(ValueError, match="read-only"):
        store.get(key, host, [0])
    with pytest.raises(ValueError, match="rank"):
        make_store(NS, 2, 2)
    with pytest.raises(ValueError, match="namespace"):
        make_store(b"short")

"""MLA latent blocks (one page per layer, no V) through every tier, and the storage tier's one
writer at tp 2: rank 0 writes each value, rank 1 acknowledges without writing, and both ranks
load the same value."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import TaskMsg
from fastkv.storage.base import HEADER_BYTES
from fastkv.storage.lmdb_store import LMDBStore
from fastkv.transfer.executor import TaskExecutor
from tests.optional import require_paddle
from tests.transfer.helpers import Supervisor, device_blocks, fill_random, key

require_paddle()

_task_ids = itertools.count(1 << 22)
LAYOUT = KVLayout(num_layers=3, kv_heads=1, block_size=16, head_dim=40, dtype="bfloat16", tp_size=2, mla=True)


def task(kind, src=(), dst=(), keys=()) -> TaskMsg:
    return TaskMsg(next(_task_ids), int(kind), np.asarray(list(src), np.int32), np.asarray(list(dst), np.int32),
                   tuple(keys))


@pytest.fixture
def sup(tmp_path):
    sup = Supervisor(layout=LAYOUT, storage_url=f"lmdb://{tmp_path}/store", runner="tiny")
    yield sup
    sup.close()


@pytest.fixture
def executors(sup):
    exs = [TaskExecutor(sup.spec, r) for r in range(LAYOUT.tp_size)]
    yield exs
    for ex in exs:
        ex.close()


def stored(tmp_path) -> tuple[int, int]:
    """(value bytes, key families) in the run's LMDB store."""
    with LMDBStore(f"{tmp_path}/store", bytes(32)) as store:
        store.check_integrity()
        return store.used_bytes(), len(store.families_lru())


def test_latent_blocks_round_trip_every_tier_and_are_stored_once(sup, executors, tmp_path):
    assert sup.devices[0].v_arrays == [] and sup.hosts[0].array.shape[1:3] == (3, 1)
    fill_random(sup.devices[0], np.random.default_rng(1))
    for dst, src in zip(sup.devices[1].k_arrays, sup.devices[0].k_arrays, strict=True):
        dst[...] = src  # the same latent on every rank
    for ex in executors:
        assert ex.run(task(CopyKind.SWAP_OUT, [3, 5], [0, 1])).ok
    dones = [ex.run(task(CopyKind.STORE, [0, 1], [], [key(0), key(1)])) for ex in executors]
    assert [d.ok for d in dones] == [True, True]
    assert [d.nbytes for d in dones] == [2 * LAYOUT.block_bytes, 0]  # rank 1 wrote nothing
    used, families = stored(tmp_path)
    assert (used, families) == (2 * (LAYOUT.block_bytes + HEADER_BYTES), 2)  # once, not once per rank
    for r, ex in enumerate(executors):  # every rank loads the one value
        sup.hosts[r].array[:] = 0
        done = ex.run(task(CopyKind.LOAD, [], [6, 7], [key(0), key(1)]))
        assert done.ok and done.nbytes == 2 * LAYOUT.block_bytes, done.error
        assert ex.run(task(CopyKind.SWAP_IN, [6, 7], [10, 11])).ok
        for got, want in zip(device_blocks(sup.devices[r], [10, 11]), device_blocks(sup.devices[0], [3, 5]),
                             strict=True):
            assert np.array_equal(got, want)


def test_a_flipped_latent_byte_on_the_host_is_caught(sup, executors):
    ex, host = executors[1], sup.hosts[1]
    fill_random(sup.devices[1], np.random.default_rng(2))
    assert ex.run(task(CopyKind.SWAP_OUT, [0, 1], [4, 5])).ok
    host.array[5].view(np.uint8).reshape(-1)[LAYOUT.block_bytes - 1] ^= 0x01  # the last layer's last byte
    done = ex.run(task(CopyKind.SWAP_IN, [4, 5], [8, 9]))
    assert not done.ok and "host blocks [5]" in done.error
    assert ex.checksum_mismatches == 1

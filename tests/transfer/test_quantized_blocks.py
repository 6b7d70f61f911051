"""A quantized layout's scales travel with their block through every tier, and the checksums
cover them like any other byte: a flipped scale byte is a miss, never a wrong dequantization."""
from __future__ import annotations

import itertools

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind
from fastkv.config import KVLayout
from fastkv.ipc import TaskMsg
from fastkv.storage import open_store
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.protocol import storage_namespace
from tests.optional import require_paddle
from tests.transfer.helpers import Supervisor, device_blocks, fill_random, key

require_paddle()

_task_ids = itertools.count(1 << 21)


def task(kind, src=(), dst=(), keys=()) -> TaskMsg:
    return TaskMsg(next(_task_ids), int(kind), np.asarray(list(src), np.int32), np.asarray(list(dst), np.int32),
                   tuple(keys))


@pytest.fixture(params=["fp8_e4m3", "int8"])
def sup(request, tmp_path):
    layout = KVLayout.of(request.param, num_layers=2, kv_heads=2, block_size=16, head_dim=32, tp_size=2)
    sup = Supervisor(layout=layout, storage_url=f"lmdb://{tmp_path}/store")
    yield sup
    sup.close()


@pytest.fixture
def ex(sup):
    ex = TaskExecutor(sup.spec, 1)
    yield ex
    ex.close()


def scale_byte(layout: KVLayout, layer: int, page: int, head: int, slot: int) -> int:
    """The offset in a host block of the first byte of one token-head row's scale."""
    part = next(p for p in layout.parts if p.page == page and p.name.endswith("_scale"))
    row = ((layer * 2 + page) * layout.kv_heads + head) * layout.block_size + slot
    return row * layout.row_elems + part.offset


def test_blocks_with_their_scales_round_trip_every_tier(sup, ex):
    layout, dev, host = sup.spec.layout, sup.devices[1], sup.hosts[1]
    fill_random(dev, np.random.default_rng(1))
    bb = layout.block_bytes
    assert ex.run(task(CopyKind.SWAP_OUT, [3, 5], [0, 1])).ok
    assert ex.run(task(CopyKind.STORE, [0, 1], [], [key(0), key(1)])).ok
    host.array[:] = 0
    done = ex.run(task(CopyKind.LOAD, [], [6, 7], [key(0), key(1)]))
    assert done.ok and done.nbytes == 2 * bb
    assert ex.run(task(CopyKind.SWAP_IN, [6, 7], [10, 11])).ok
    for got, want in zip(device_blocks(dev, [10, 11]), device_blocks(dev, [3, 5]), strict=True):
        assert np.array_equal(got, want)


def test_a_flipped_scale_byte_on_the_host_is_caught(sup, ex):
    layout, dev, host = sup.spec.layout, sup.devices[1], sup.hosts[1]
    fill_random(dev, np.random.default_rng(2))
    assert ex.run(task(CopyKind.SWAP_OUT, [0, 1], [4, 5])).ok
    host.array[5].reshape(-1)[scale_byte(layout, 1, 1, 1, 7) + 2] ^= 0x01  # a bit of a V scale
    done = ex.run(task(CopyKind.SWAP_IN, [4, 5], [8, 9]))
    assert not done.ok and "host blocks [5]" in done.error
    assert ex.checksum_mismatches == 1


def test_a_flipped_scale_byte_in_storage_is_a_miss(sup, ex):
    layout, dev, host = sup.spec.layout, sup.devices[1], sup.hosts[1]
    fill_random(dev, np.random.default_rng(3))
    assert ex.run(task(CopyKind.SWAP_OUT, [2], [0])).ok
    assert ex.run(task(CopyKind.STORE, [0], [], [key(7)])).ok
    with open_store(sup.spec.storage_url, storage_namespace(sup.spec, "0"), 1, 2) as store:
        value = bytearray(store.get_raw(key(7)))
        value[len(value) - layout.block_bytes + scale_byte(layout, 0, 0, 0, 3)] ^= 0x80  # a K scale's low byte
        store.put_raw(key(7), bytes(value))
    before = host.array[9].copy()
    done = ex.run(task(CopyKind.LOAD, [], [9], [key(7)]))
    assert not done.ok and done.nbytes == 0
    assert np.array_equal(host.array[9], before), "a corrupt value reached the host block"

"""Host block checksums in the CPU kernel (ops/block_digest.h) against their reference
(``fastkv.transfer.tiers.block_checksum``): read from a host block, and written by a SWAP_OUT
from each source page as it copies it, by every copy method and thread split."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest

from fastkv import ops
from fastkv.transfer.tiers import block_checksum

pytestmark = pytest.mark.usefixtures("paddle_ops")

GEOMETRIES = [(1, 64), (2, 96), (3, 200), (8, 4096), (2, (128 << 10) + 32)]


def reference(host: np.ndarray, ids) -> list[bytes]:
    return [block_checksum(host[b]) for b in ids]


@pytest.mark.parametrize("layers,page", GEOMETRIES)
def test_the_kernel_reads_the_checksums_the_reference_computes(layers, page):
    rng = np.random.default_rng(page)
    host = rng.integers(0, 256, (5, layers, 2, page), dtype=np.uint8)
    ids = [4, 0, 2, 2]
    assert [row.tobytes() for row in ops.block_checksums(host, ids)] == reference(host, ids)


@pytest.mark.parametrize("layers,page", [(1, 64), (3, 200)])
def test_one_changed_byte_in_any_page_changes_the_checksum(layers, page):
    host = np.zeros((1, layers, 2, page), np.uint8)
    clean = ops.block_checksums(host, [0])[0].tobytes()
    assert clean == block_checksum(host[0])
    for layer in range(layers):
        for kv in (0, 1):
            for at in (0, page - 1):
                host[0, layer, kv, at] ^= 1
                assert ops.block_checksums(host, [0])[0].tobytes() != clean, (layer, kv, at)
                assert block_checksum(host[0]) != clean
                host[0, layer, kv, at] ^= 1


def test_out_of_range_ids_are_refused():
    host = np.zeros((2, 1, 2, 64), np.uint8)
    with pytest.raises(ValueError, match="host block 2 out of range"):
        ops.block_checksums(host, [0, 2])


@pytest.mark.parametrize("layers,page", GEOMETRIES)
@pytest.mark.parametrize("method,threads", [(0, 1), (1, 1), (1, 3), (0, 2)])
def test_a_swap_out_writes_its_destinations_checksums_as_it_copies(layers, page, method, threads):
    lib, rng, ndev, nhost, n = ops.c_abi(), np.random.default_rng(layers * page + method), 9, 7, 5
    k = [rng.integers(0, 256, ndev * page, dtype=np.uint8) for _ in range(layers)]
    v = [rng.integers(0, 256, ndev * page, dtype=np.uint8) for _ in range(layers)]
    host = rng.integers(0, 256, (nhost, layers, 2, page), dtype=np.uint8)
    sums = np.full((nhost, 16), 0xAB, np.uint8)
    src, dst = rng.permutation(ndev)[:n].astype(np.int32), rng.permutation(nhost)[:n].astype(np.int32)
    ptrs = [(ctypes.c_void_p * layers)(*(a.ctypes.data for a in t)) for t in (k, v)]
    assert lib.fkv_cpu_swap(ptrs[0], ptrs[1], layers, host.ctypes.data, page, ndev, nhost, src.ctypes.data,
                            dst.ctypes.data, n, 1, threads, method, sums.ctypes.data) == 0, lib.fkv_cpu_last_error()
    for s, d in zip(src, dst, strict=True):
        for layer in range(layers):
            assert np.array_equal(host[d, layer, 0], k[layer][s * page:(s + 1) * page])
            assert np.array_equal(host[d, layer, 1], v[layer][s * page:(s + 1) * page])
    assert [sums[d].tobytes() for d in dst] == reference(host, dst)
    untouched = sorted(set(range(nhost)) - set(dst.tolist()))
    assert (sums[untouched] == 0xAB).all(), "a block the swap did not write kept its checksum"


def test_a_swap_in_leaves_the_checksums_alone():
    lib, layers, page, n = ops.c_abi(), 2, 128, 3
    k = [np.zeros(4 * page, np.uint8) for _ in range(layers)]
    v = [np.zeros(4 * page, np.uint8) for _ in range(layers)]
    host = np.ones((4, layers, 2, page), np.uint8)
    sums = np.full((4, 16), 7, np.uint8)
    ids = np.arange(n, dtype=np.int32)
    ptrs = [(ctypes.c_void_p * layers)(*(a.ctypes.data for a in t)) for t in (k, v)]
    assert lib.fkv_cpu_swap(ptrs[0], ptrs[1], layers, host.ctypes.data, page, 4, 4, ids.ctypes.data, ids.ctypes.data,
                            n, 0, 1, 0, sums.ctypes.data) == 0
    assert k[0][:n * page].all() and (sums == 7).all()


def test_a_bound_swap_refuses_checksums_of_the_wrong_shape(paddle_ops):
    from fastkv.config import KVLayout

    lay = KVLayout(num_layers=1, kv_heads=1, block_size=2, head_dim=4, dtype="float32")
    k = [paddle_ops.zeros(lay.device_shape(3), dtype="float32")]
    v = [paddle_ops.zeros(lay.device_shape(3), dtype="float32")]
    host = paddle_ops.ones(lay.host_shape(2), dtype="float32")
    bound = ops.BoundSwap(k, v, host)
    ids = np.array([0], np.int32)
    with pytest.raises(ValueError, match=r"sums must be a C-contiguous uint8 \[2, 16\] array"):
        bound.swap(ids, ids, to_host=True, num_threads=1, sums=np.zeros((3, 16), np.uint8))
    sums = np.zeros((2, 16), np.uint8)
    assert bound.swap(ids, ids, to_host=True, num_threads=1, sums=sums)
    assert sums[0].tobytes() == block_checksum(host.numpy()[0]) and not sums[1].any()
    assert not bound.swap(ids, ids, to_host=False, num_threads=1, sums=sums), "a SWAP_IN writes no checksum"


def test_calls_that_hold_the_gil_give_the_same_checksums_and_run_no_other_python_thread():
    """``c_abi(hold_gil=True)`` is the transfer loop's: no other Python thread of the process
    (its low-priority storage thread) runs while it checks a SWAP_IN's blocks or copies."""
    from tests.ipc.test_doorbell_spin import longest_stall_of_another_thread

    host = np.random.default_rng(0).integers(0, 256, (64, 8, 2, 128 << 10), dtype=np.uint8)  # 128 MiB
    ids = list(range(64))
    assert np.array_equal(ops.block_checksums(host, ids, hold_gil=True), ops.block_checksums(host, ids))
    t0 = time.perf_counter()
    ops.block_checksums(host, ids)
    one = time.perf_counter() - t0  # ~5-15 ms
    held = longest_stall_of_another_thread(lambda: ops.block_checksums(host, ids, hold_gil=True))
    released = longest_stall_of_another_thread(lambda: ops.block_checksums(host, ids))
    assert held >= 0.5 * one, (held, one)
    assert released < 0.5 * held, (released, held)

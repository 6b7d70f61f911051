"""Host block checksums in the CPU kernel (ops/block_digest.h) against their reference
(``fastkv.transfer.tiers.block_checksum``): read from a host block, and written by a SWAP_OUT
from each page in its copy's pass (fused) or after it (separate), by every copy method and
thread split; a block changed after its SWAP_OUT fails its check."""
from __future__ import annotations

import ctypes
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fastkv.kernels import ops
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


@pytest.fixture
def fused_mode():
    """Sets how SWAP_OUTs hash their pages (ops.set_fused_checksums) and puts the default back."""
    modes = []

    def use(mode: int) -> None:
        try:
            modes.append(ops.set_fused_checksums(mode))
        except ValueError:  # no AVX2 on this CPU: nothing to compare
            pytest.skip(f"this CPU has no build for fused checksums mode {mode}")

    yield use
    if modes:
        ops.set_fused_checksums(modes[0])


def swap_out_sums(layers, page, ndev, nhost, src, dst, method, threads, data_seed, host_offset=0):
    """(host blocks [nhost, layers, 2, page], checksums [nhost, 16]) after one fkv_cpu_swap
    SWAP_OUT from seeded random device pages; ``host_offset`` bytes shift the host tier off
    the cache-line grid."""
    lib, rng = ops.c_abi(), np.random.default_rng(data_seed)
    k = [rng.integers(0, 256, ndev * page, dtype=np.uint8) for _ in range(layers)]
    v = [rng.integers(0, 256, ndev * page, dtype=np.uint8) for _ in range(layers)]
    raw = np.zeros(nhost * layers * 2 * page + 64 + host_offset, np.uint8)
    start = (-raw.ctypes.data) % 64 + host_offset
    host = raw[start:start + nhost * layers * 2 * page].reshape(nhost, layers, 2, page)
    sums = np.zeros((nhost, 16), np.uint8)
    src, dst = np.asarray(src, np.int32), np.asarray(dst, np.int32)
    ptrs = [(ctypes.c_void_p * layers)(*(a.ctypes.data for a in t)) for t in (k, v)]
    assert lib.fkv_cpu_swap(ptrs[0], ptrs[1], layers, host.ctypes.data, page, ndev, nhost, src.ctypes.data,
                            dst.ctypes.data, len(src), 1, threads, method, sums.ctypes.data) == 0, \
        lib.fkv_cpu_last_error()
    for s, d in zip(src, dst, strict=True):
        for layer in range(layers):
            assert np.array_equal(host[d, layer, 0], k[layer][s * page:(s + 1) * page])
            assert np.array_equal(host[d, layer, 1], v[layer][s * page:(s + 1) * page])
    return host, sums


FUSED_MODES = [1, 2]  # the best build for this CPU, the AVX2 build


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(layers=st.integers(1, 4),
       page=st.one_of(st.integers(1, 3000), st.sampled_from([240, 241, 1024, 1025, 1088, 2049, 8192 + 64])),
       n=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       how=st.sampled_from([(0, 1), (1, 1), (1, 2), (0, 2)]), host_offset=st.sampled_from([0, 0, 8, 32]))
def test_a_fused_swap_out_writes_the_checksums_the_separate_hash_writes(fused_mode, layers, page, n, seed, how,
                                                                        host_offset):
    """Fused (each page hashed in its copy's pass) == separate (each page hashed after its
    copy) == the reference, on random bytes, layouts, block ids, copy methods and thread
    splits, with the host tier on and off the streaming-store grid."""
    rng = np.random.default_rng(seed)
    ndev, nhost = n + 2, n + 3
    src, dst = rng.permutation(ndev)[:n], rng.permutation(nhost)[:n]
    got = {}
    for mode in [0, *FUSED_MODES]:
        fused_mode(mode)
        host, sums = swap_out_sums(layers, page, ndev, nhost, src, dst, *how, seed, host_offset)
        got[mode] = sums
    for mode in FUSED_MODES:
        assert np.array_equal(got[mode], got[0]), f"mode {mode} differs from the separate hash"
    assert [got[1][d].tobytes() for d in dst] == reference(host, dst)
    untouched = sorted(set(range(nhost)) - set(dst.tolist()))
    assert not got[1][untouched].any(), "a block the swap did not write got a checksum"


@pytest.mark.parametrize("mode", FUSED_MODES)
@pytest.mark.parametrize("layers,page", [(1, 241), (2, 4096), (8, 128 << 10)])
def test_a_block_corrupted_after_a_fused_swap_out_fails_its_check(fused_mode, mode, layers, page):
    """The checksum a fused SWAP_OUT wrote catches a changed byte anywhere in the host block,
    as the SWAP_IN's and STORE's check (``HostTier.corrupt``: ``ops.block_checksums``) sees it."""
    fused_mode(mode)
    host, sums = swap_out_sums(layers, page, 3, 2, [2, 0], [1, 0], 1, 1, page)
    assert np.array_equal(ops.block_checksums(host, [0, 1]), sums[[0, 1]]), "clean blocks must pass"
    rng = np.random.default_rng(mode)
    for _ in range(6):
        layer, kv, at = int(rng.integers(layers)), int(rng.integers(2)), int(rng.integers(page))
        bit = np.uint8(1 << int(rng.integers(8)))
        host[1, layer, kv, at] ^= bit
        assert not np.array_equal(ops.block_checksums(host, [1])[0], sums[1]), (layer, kv, at)
        assert np.array_equal(ops.block_checksums(host, [0])[0], sums[0]), "the other block still passes"
        host[1, layer, kv, at] ^= bit
        assert np.array_equal(ops.block_checksums(host, [1])[0], sums[1]), "restored, the block passes again"


def test_fused_checksum_modes_are_checked():
    was = ops.set_fused_checksums(1)
    try:
        with pytest.raises(ValueError, match="fused checksums mode 3"):
            ops.set_fused_checksums(3)
        assert ops.set_fused_checksums(1) == 1, "a refused mode changed the setting"
    finally:
        ops.set_fused_checksums(was)


def test_the_op_writes_a_swap_outs_checksums_at_the_address_it_is_given(paddle_ops):
    """``swap_blocks(..., sums_addr=...)``: the Paddle op's path (a GPU SWAP_OUT's on a CUDA
    build; on the CPU the same fused kernel) writes each destination's checksum there."""
    from fastkv.config import KVLayout

    lay = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=16, dtype="float32")
    rng = np.random.default_rng(5)
    k = [paddle_ops.to_tensor(rng.standard_normal(lay.device_shape(4)).astype(np.float32)) for _ in range(2)]
    v = [paddle_ops.to_tensor(rng.standard_normal(lay.device_shape(4)).astype(np.float32)) for _ in range(2)]
    host = paddle_ops.zeros(lay.host_shape(3), dtype="float32")
    sums = np.zeros((3, 16), np.uint8)
    ops.swap_out(k, v, host, [3, 1], [2, 0], num_threads=1, sums_addr=sums.ctypes.data)
    assert [sums[b].tobytes() for b in (2, 0)] == reference(host.numpy(), [2, 0])
    assert not sums[1].any(), "a block the swap did not write got a checksum"
    ops.swap_in(k, v, host, [2], [0], num_threads=1, sums_addr=sums.ctypes.data)
    assert not sums[1].any(), "a SWAP_IN writes no checksum"

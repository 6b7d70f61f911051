"""fastkv_swap_blocks against the numpy reference: ids, shapes, dtypes, directions, thread counts."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from fastkv.config import KVLayout
from fastkv.kernels import ops
from tests.ops.conftest import Tiers

DTYPES = ["float32", "float16", "bfloat16", "uint8", "int8"]


@st.composite
def swap_cases(draw):
    mla = draw(st.booleans())  # one latent page per layer, no V
    layout = KVLayout(
        num_layers=draw(st.integers(1, 4)),
        kv_heads=1 if mla else draw(st.integers(1, 3)),
        block_size=draw(st.integers(1, 4)),
        head_dim=draw(st.integers(1, 8)),
        dtype=draw(st.sampled_from(DTYPES)),
        mla=mla,
    )
    num_dev, num_host = draw(st.integers(1, 10)), draw(st.integers(1, 10))
    to_host = draw(st.booleans())
    num_src, num_dst = (num_dev, num_host) if to_host else (num_host, num_dev)
    if draw(st.booleans()):  # one run of consecutive ids on both sides (the coalesced path)
        n = draw(st.integers(0, min(num_src, num_dst)))
        s0, d0 = draw(st.integers(0, num_src - n)), draw(st.integers(0, num_dst - n))
        src, dst = list(range(s0, s0 + n)), list(range(d0, d0 + n))
    else:  # scattered: sources may repeat, destinations may not
        dst = draw(st.permutations(range(num_dst)))[: draw(st.integers(0, num_dst))]
        src = draw(st.lists(st.integers(0, num_src - 1), min_size=len(dst), max_size=len(dst)))
    return layout, num_dev, num_host, to_host, src, dst, draw(st.integers(1, 4)), draw(st.integers(0, 2**32 - 1))


@given(swap_cases())
def test_swap_matches_reference(paddle_ops, case):
    layout, num_dev, num_host, to_host, src, dst, threads, seed = case
    tiers = Tiers(layout, num_dev, num_host, np.random.default_rng(seed))
    expected = tiers.snapshot()
    ops.swap_blocks_ref(expected[: layout.num_layers], expected[layout.num_layers : -1], expected[-1], src, dst,
                        to_host=to_host)
    ops.swap_blocks(tiers.k_t, tiers.v_t, tiers.host_t, np.array(src, np.int64), np.array(dst, np.int64),
                    to_host=to_host, num_threads=threads)
    tiers.assert_bytes_equal(expected)


@pytest.mark.parametrize("threads", [2, 3, 4, 7])
@pytest.mark.parametrize("to_host", [True, False])
def test_threads_split_large_swaps(paddle_ops, threads, to_host):
    # 256 KiB pages, 13 pairs x 3 layers x 2 = 78 pages (19.5 MiB): enough bytes for several threads,
    # and a page count no thread count divides evenly.
    layout = KVLayout(num_layers=3, kv_heads=4, block_size=32, head_dim=512, dtype="float32")
    rng = np.random.default_rng(threads)
    tiers = Tiers(layout, 20, 16, rng)
    num_src, num_dst = (20, 16) if to_host else (16, 20)
    dst = rng.permutation(num_dst)[:13]
    src = rng.integers(0, num_src, 13)
    expected = tiers.snapshot()
    ops.swap_blocks_ref(expected[:3], expected[3:6], expected[6], src, dst, to_host=to_host)
    ops.swap_blocks(tiers.k_t, tiers.v_t, tiers.host_t, src, dst, to_host=to_host, num_threads=threads)
    tiers.assert_bytes_equal(expected)


@pytest.mark.parametrize("to_host", [True, False])
def test_streaming_copies_of_unaligned_pages(paddle_ops, to_host):
    # 11211-byte pages: past 1 MiB per call the kernel uses streaming stores, whose aligned body
    # needs a head and a tail copy on every page that does not start on 32 bytes.
    layout = KVLayout(num_layers=3, kv_heads=3, block_size=37, head_dim=101, dtype="uint8")
    rng = np.random.default_rng(11)
    tiers = Tiers(layout, 40, 30, rng)
    num_src, num_dst = (40, 30) if to_host else (30, 40)
    dst = rng.permutation(num_dst)[:20]
    src = rng.integers(0, num_src, 20)
    expected = tiers.snapshot()
    ops.swap_blocks_ref(expected[:3], expected[3:6], expected[6], src, dst, to_host=to_host)
    ops.swap_blocks(tiers.k_t, tiers.v_t, tiers.host_t, src, dst, to_host=to_host, num_threads=1)
    tiers.assert_bytes_equal(expected)


def test_swap_out_then_in_round_trips(paddle_ops):
    layout = KVLayout(num_layers=2, kv_heads=2, block_size=16, head_dim=32, dtype="bfloat16")
    tiers = Tiers(layout, 8, 8, np.random.default_rng(7))
    original = [a.copy() for a in (*tiers.k, *tiers.v)]
    device_ids, host_ids = np.array([5, 1, 2, 3]), np.array([0, 7, 4, 5])
    ops.swap_out(tiers.k_t, tiers.v_t, tiers.host_t, device_ids, host_ids, num_threads=2)
    for a in (*tiers.k, *tiers.v):
        a[device_ids] = 0
    ops.swap_in(tiers.k_t, tiers.v_t, tiers.host_t, host_ids, device_ids, num_threads=2)
    for got, want in zip((*tiers.k, *tiers.v), original, strict=True):
        assert np.array_equal(got, want)


def test_empty_id_lists_are_a_no_op(paddle_ops):
    layout = KVLayout(num_layers=1, kv_heads=1, block_size=2, head_dim=4, dtype="float16")
    tiers = Tiers(layout, 3, 3, np.random.default_rng(1))
    before = tiers.snapshot()
    ops.swap_blocks(tiers.k_t, tiers.v_t, tiers.host_t, [], [], to_host=True)
    tiers.assert_bytes_equal(before)


def test_paddle_surfaces_op_checks_as_oserror(paddle_ops):
    # What ops.swap_blocks relies on: a PD_CHECK in the op arrives in Python as OSError.
    from paddle.utils.dlpack import from_dlpack

    layout = KVLayout(num_layers=1, kv_heads=1, block_size=2, head_dim=4, dtype="float32")
    tiers = Tiers(layout, 2, 2, np.random.default_rng(1))
    ids = from_dlpack(np.array([9], np.int32))
    with pytest.raises(OSError, match="out of range"):
        paddle_ops._C_ops._run_custom_op("fastkv_swap_blocks", tiers.k_t, tiers.v_t, tiers.host_t, ids, ids, True, 1, 0,
                                         0)


def test_paddle_copies_strided_inputs_of_custom_ops(paddle_ops):
    # Why ops.swap_blocks refuses strided views: Paddle passes the op a contiguous copy, so an
    # in-place write would be lost without an error.
    from paddle.utils.dlpack import from_dlpack

    layout = KVLayout(num_layers=1, kv_heads=1, block_size=2, head_dim=4, dtype="float32")
    tiers = Tiers(layout, 2, 2, np.random.default_rng(1))
    wide = paddle_ops.zeros([2, 1, 2, 8], dtype="float32")
    view = wide[:, :, :, :4]
    assert not view.is_contiguous()
    ids = from_dlpack(np.array([0], np.int32))
    paddle_ops._C_ops._run_custom_op("fastkv_swap_blocks", [view], tiers.v_t, tiers.host_t, ids, ids, False, 1, 0, 0)
    assert float(wide.abs().sum()) == 0.0, "Paddle now writes strided inputs in place: the wrapper check can go"


def _aligned(nbytes: int, rng: np.random.Generator, offset: int = 0) -> np.ndarray:
    """Random bytes starting ``offset`` bytes past a page boundary."""
    raw = np.empty(nbytes + 8192, np.uint8)
    start = -raw.ctypes.data % 4096 + offset
    out = raw[start:start + nbytes]
    out[:] = rng.integers(0, 256, nbytes, dtype=np.uint8)
    return out


@pytest.mark.parametrize("page", [32, 96, 1056, 5 * 1024 + 160, (128 << 10) + 32])
@pytest.mark.parametrize("offset", [0, 16])
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("to_host", [True, False])
def test_forced_streaming_copies_match_the_reference(page, offset, threads, to_host):
    """Streaming stores, two pages side by side in chunks (ops/swap_common.h): page sizes that
    are and are not multiples of a chunk or of the stream loop, destinations on and off the
    32-byte grid (those go one page at a time), odd page counts per thread."""
    lib, rng, layers, ndev, nhost, n = ops.c_abi(), np.random.default_rng(page + offset), 2, 9, 7, 5
    k = [_aligned(ndev * page, rng, offset) for _ in range(layers)]
    v = [_aligned(ndev * page, rng, offset) for _ in range(layers)]
    host = _aligned(nhost * 2 * layers * page, rng, offset)
    dev_ids, host_ids = rng.permutation(ndev)[:n].astype(np.int32), rng.permutation(nhost)[:n].astype(np.int32)
    src, dst = (dev_ids, host_ids) if to_host else (host_ids, dev_ids)
    hv = host.reshape(nhost, layers, 2, page)
    want_k, want_v, want_h = [a.copy() for a in k], [a.copy() for a in v], hv.copy()
    for d, h in zip(dev_ids, host_ids, strict=True):
        for layer in range(layers):
            for kv, tier in ((0, want_k), (1, want_v)):
                if to_host:
                    want_h[h, layer, kv] = tier[layer][d * page:(d + 1) * page]
                else:
                    tier[layer][d * page:(d + 1) * page] = hv[h, layer, kv]
    ptrs = [(ctypes.c_void_p * layers)(*(a.ctypes.data for a in t)) for t in (k, v)]
    assert lib.fkv_cpu_swap(ptrs[0], ptrs[1], layers, host.ctypes.data, page, ndev, nhost, src.ctypes.data,
                            dst.ctypes.data, n, int(to_host), threads, 1, None) == 0, lib.fkv_cpu_last_error()
    assert np.array_equal(hv, want_h)
    for got, want in ((k, want_k), (v, want_v)):
        assert all(np.array_equal(g, w) for g, w in zip(got, want, strict=True))

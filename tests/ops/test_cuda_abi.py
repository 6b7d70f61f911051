"""The CUDA swap through its C ABI: nvcc builds it (skipped without nvcc); it validates without a GPU;
on a GPU it matches the numpy reference byte for byte (skipped without one)."""
from __future__ import annotations

import ctypes

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.kernels import cuda_abi, ops

pytestmark = pytest.mark.skipif(cuda_abi.find_nvcc() is None, reason="nvcc not found")


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = cuda_abi.build(tmp_path_factory.mktemp("cuda_abi"))
    return cuda_abi.CudaSwapLib(path)


def test_cuda_sources_compile_and_export_the_abi(lib):
    for name in ("fkv_cuda_swap", "fkv_cuda_swap_landed", "fkv_cuda_wait", "fkv_cuda_last_error",
                 "fkv_cuda_host_register", "fkv_cuda_time_memcpy"):
        assert hasattr(lib.lib, name), f"{name} is not exported"


@pytest.mark.parametrize(
    "src,dst,to_host,fragment",
    [
        ([0, 4], [1, 2], True, "src id 4"),  # 4 device blocks
        ([0, 1], [1, 3], True, "dst id 3"),  # 3 host blocks
        ([3, 0], [0, 1], False, "src id 3"),
        ([0, 1], [2, 2], True, "appears twice"),
        ([-1], [0], True, "src id -1"),
    ],
)
def test_bad_ids_fail_before_any_cuda_call(lib, src, dst, to_host, fragment):
    # Null tier pointers would crash a copy: the ids must be refused before anything touches them.
    with pytest.raises(cuda_abi.CudaError, match=fragment):
        lib.swap([1], [2], 3, 16, 4, 3, np.array(src), np.array(dst), to_host=to_host)


def test_bad_geometry_is_refused(lib):
    with pytest.raises(cuda_abi.CudaError, match="page_bytes"):
        lib.swap([1], [2], 3, 0, 4, 3, np.array([0]), np.array([0]), to_host=True)
    with pytest.raises(ValueError, match="equal lengths"):
        lib.swap([1], [2], 3, 16, 4, 3, np.array([0, 1]), np.array([0]), to_host=True)


@pytest.fixture(scope="module")
def gpu(lib):
    if lib.device_count() == 0:
        pytest.skip("no CUDA device")
    return lib


class GpuTiers:
    """Device tier in cudaMalloc'ed memory, host tier in cudaHostAlloc'ed memory, numpy mirrors of both."""

    def __init__(self, lib, layout: KVLayout, num_dev: int, num_host: int, seed: int) -> None:
        self.lib, self.layout = lib, layout
        rng = np.random.default_rng(seed)
        self.k = [rng.integers(0, 256, (num_dev, layout.page_bytes), dtype=np.uint8) for _ in range(layout.num_layers)]
        self.v = [rng.integers(0, 256, (num_dev, layout.page_bytes), dtype=np.uint8)
                  for _ in range(layout.num_layers if layout.kv_pages == 2 else 0)]  # MLA: no V
        self.host = rng.integers(0, 256, (num_host, layout.num_layers, layout.kv_pages, layout.page_bytes),
                                 dtype=np.uint8)
        self.dk = [self._upload(a) for a in self.k]
        self.dv = [self._upload(a) for a in self.v]
        self.hp = lib.host_alloc(self.host.nbytes)
        lib.memcpy(self.hp, self.host.ctypes.data, self.host.nbytes)

    def _upload(self, array: np.ndarray) -> int:
        ptr = self.lib.malloc(array.nbytes)
        self.lib.memcpy(ptr, array.ctypes.data, array.nbytes)
        return ptr

    def download(self) -> list[np.ndarray]:
        out = []
        for ptr, like in [*zip(self.dk, self.k, strict=True), *zip(self.dv, self.v, strict=True), (self.hp, self.host)]:
            arr = np.empty_like(like)
            self.lib.memcpy(arr.ctypes.data, ptr, arr.nbytes)
            out.append(arr)
        return out

    def free(self) -> None:
        for ptr in (*self.dk, *self.dv):
            self.lib.free(ptr)
        self.lib.host_free(self.hp)


@pytest.mark.parametrize("mode", ["all-dma", "all-kernel", "mixed"])
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("page_align", [True, False], ids=["16B-pages", "odd-pages"])
@pytest.mark.parametrize("mla", [False, True], ids=["kv", "mla"])
def test_gpu_swap_matches_reference(gpu, mode, to_host, page_align, mla):
    layout = KVLayout(num_layers=3, kv_heads=1 if mla else 2, block_size=16, head_dim=64 if page_align else 3,
                      dtype="uint8", mla=mla)
    # mixed: the 5-block run goes to the DMA engines, single blocks to the gather kernel.
    dma_min_bytes = {"all-dma": 0, "all-kernel": 1 << 62, "mixed": 3 * layout.page_bytes}[mode]
    num_dev, num_host = 24, 20
    rng = np.random.default_rng(int(to_host) + 2 * int(page_align))
    num_src, num_dst = (num_dev, num_host) if to_host else (num_host, num_dev)
    # A run of 5 consecutive pairs (DMA when long enough), then scattered ones.
    dst = np.concatenate([np.arange(2, 7), rng.permutation(np.arange(7, num_dst))[:8]])
    src = np.concatenate([np.arange(10, 15), rng.integers(0, num_src, 8)])
    tiers = GpuTiers(gpu, layout, num_dev, num_host, seed=5)
    try:
        expected_k, expected_v, expected_h = [a.copy() for a in tiers.k], [a.copy() for a in tiers.v], tiers.host.copy()
        ops.swap_blocks_ref(expected_k, expected_v, expected_h, src, dst, to_host=to_host)
        gpu.swap(tiers.dk, tiers.dv, tiers.hp, layout.page_bytes, num_dev, num_host, src, dst, to_host=to_host,
                 dma_min_bytes=dma_min_bytes)
        got = tiers.download()
        for i, (g, want) in enumerate(zip(got, [*expected_k, *expected_v, expected_h], strict=True)):
            assert np.array_equal(g, want), f"array {i} differs from the reference"
    finally:
        tiers.free()


@pytest.mark.parametrize("mode", ["all-dma", "all-kernel", "mixed"])
@pytest.mark.parametrize("unit_blocks", [1, 3, 100])
def test_a_landed_swap_out_reports_every_pair_once_after_its_bytes_are_in_host_memory(gpu, mode, unit_blocks):
    """fkv_cuda_swap_landed: the same bytes as fkv_cuda_swap; each pair reported once, in units
    of at most unit_bytes (at least one pair), and its host block holds its device block's
    bytes when it is reported (the op hashes it there: host checksums)."""
    layout = KVLayout(num_layers=3, kv_heads=2, block_size=16, head_dim=64, dtype="uint8")
    dma_min_bytes = {"all-dma": 0, "all-kernel": 1 << 62, "mixed": 3 * layout.page_bytes}[mode]
    num_dev, num_host = 24, 20
    rng = np.random.default_rng(unit_blocks)
    dst = np.concatenate([np.arange(2, 7), rng.permutation(np.arange(7, num_host))[:8]])
    src = np.concatenate([np.arange(10, 15), rng.permutation(num_dev)[:8]])
    tiers = GpuTiers(gpu, layout, num_dev, num_host, seed=7)
    host = np.ctypeslib.as_array(ctypes.cast(tiers.hp, ctypes.POINTER(ctypes.c_uint8)), shape=tiers.host.shape)
    try:
        expected_k, expected_v, expected_h = [a.copy() for a in tiers.k], [a.copy() for a in tiers.v], tiers.host.copy()
        ops.swap_blocks_ref(expected_k, expected_v, expected_h, src, dst, to_host=True)
        units, wrong = [], []

        def on_landed(pairs):
            units.append(pairs)
            wrong.extend(i for i in pairs if not np.array_equal(host[dst[i]], expected_h[dst[i]]))

        gpu.swap_landed(tiers.dk, tiers.dv, tiers.hp, layout.page_bytes, num_dev, num_host, src, dst,
                        unit_bytes=unit_blocks * layout.block_bytes, on_landed=on_landed, dma_min_bytes=dma_min_bytes)
        assert sorted(i for u in units for i in u) == list(range(len(src))), units
        assert all(1 <= len(u) <= unit_blocks for u in units), units
        assert not wrong, f"pairs {wrong} were reported before their bytes landed"
        assert np.array_equal(tiers.download()[-1], expected_h)
    finally:
        tiers.free()


def test_gpu_refuses_unpinned_host_memory(gpu):
    layout = KVLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=16, dtype="uint8")
    tiers = GpuTiers(gpu, layout, 4, 4, seed=1)
    pageable = np.zeros_like(tiers.host)
    try:
        with pytest.raises(cuda_abi.CudaError, match="not pinned"):
            gpu.swap(tiers.dk, tiers.dv, pageable.ctypes.data, layout.page_bytes, 4, 4, np.array([0]), np.array([1]),
                     to_host=True)
        gpu.host_register(pageable.ctypes.data, pageable.nbytes)
        gpu.swap(tiers.dk, tiers.dv, pageable.ctypes.data, layout.page_bytes, 4, 4, np.array([0]), np.array([1]),
                 to_host=True)
        gpu.host_unregister(pageable.ctypes.data)
        assert np.array_equal(pageable[1, 0, 0], tiers.k[0][0])
    finally:
        tiers.free()

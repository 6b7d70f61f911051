"""The CUDA swap kernels without Paddle: build ``ops/swap_cuda.cu`` with nvcc, call it through ctypes.

For testing and measuring the CUDA path on a GPU machine that has no CUDA build of Paddle
(tests/ops/test_cuda_abi.py, scripts/gpu_swap_check.py). The serving path uses the Paddle op,
which calls the same C functions. See ops/swap_cuda.h for their contract.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np

from fastkv.kernels import cuda_arch
from fastkv.kernels.ops import OPS_DIR

# sm_80 (A100), sm_90 (H100/H200) native code, plus PTX so newer GPUs JIT it.
DEFAULT_ARCH_FLAGS = cuda_arch.DEFAULT_FLAGS
# Every warning, nvcc's and the host compiler's, fails the build (CI: scripts/check_gpu_build.sh).
WERROR_FLAGS = ("-Werror", "all-warnings", "-Xcompiler", "-Wall,-Wextra,-Werror")


def _wheel_nvcc() -> list[str]:
    """nvcc of the pip wheels (nvidia-cuda-nvcc: nvidia/cu13/bin), if installed."""
    spec = importlib.util.find_spec("nvidia")
    return [str(Path(loc) / "cu13" / "bin" / "nvcc") for loc in (spec.submodule_search_locations or [])] if spec else []


def find_nvcc() -> str | None:
    for candidate in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc", *_wheel_nvcc()):
        if candidate and Path(candidate).is_file():
            return candidate
    return None


def build(dest_dir: Path, nvcc: str | None = None, arch_flags: tuple[str, ...] | None = None,
          warnings_as_errors: bool = False) -> Path:
    """Compiles the C ABI library into ``dest_dir/libfkv_swap_cuda.so``; returns its path.
    arch_flags: default ``cuda_arch.gencode_flags()`` ($FASTKV_CUDA_ARCH, else sm_80, sm_90 + PTX)."""
    nvcc = nvcc or find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found (set NVCC or put it on PATH)")
    arch_flags = cuda_arch.gencode_flags() if arch_flags is None else arch_flags
    dest_dir = Path(dest_dir)
    dest_dir.mkdir(parents=True, exist_ok=True)
    out = dest_dir / "libfkv_swap_cuda.so"
    # --threads 0: one nvcc thread per architecture, as many at once as there are cores
    cmd = [nvcc, "-O3", "-std=c++17", "-shared", "-Xcompiler", "-fPIC", "--threads", "0", *arch_flags,
           *(WERROR_FLAGS if warnings_as_errors else ()), f"-I{OPS_DIR}", "-o", str(out), str(OPS_DIR / "swap_cuda.cu")]
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"nvcc failed ({' '.join(cmd)}):\n{result.stderr}")
    return out


class CudaError(RuntimeError):
    pass


_I64, _I32, _P = ctypes.c_int64, ctypes.c_int32, ctypes.c_void_p
LANDED_FN = ctypes.CFUNCTYPE(None, _P, ctypes.POINTER(_I32), _I64)  # fkv_landed_fn


class CudaSwapLib:
    """ctypes bindings of ops/swap_cuda.h; every call raises CudaError with the library's message."""

    def __init__(self, path: Path) -> None:
        self.lib = ctypes.CDLL(str(path))
        sig = {
            "fkv_cuda_swap": [ctypes.POINTER(_P), ctypes.POINTER(_P), _I64, _P, _I64, _I64, _I64, _P, _P, _I64, _I32,
                              _I64, _P, _I32],
            "fkv_cuda_swap_landed": [ctypes.POINTER(_P), ctypes.POINTER(_P), _I64, _P, _I64, _I64, _I64, _P, _P, _I64,
                                     _I64, _P, _I64, LANDED_FN, _P],
            "fkv_cuda_wait": [],
            "fkv_cuda_host_register": [_P, _I64],
            "fkv_cuda_host_unregister": [_P],
            "fkv_cuda_device_count": [ctypes.POINTER(_I32)],
            "fkv_cuda_set_device": [_I32],
            "fkv_cuda_malloc": [ctypes.POINTER(_P), _I64],
            "fkv_cuda_free": [_P],
            "fkv_cuda_host_alloc": [ctypes.POINTER(_P), _I64],
            "fkv_cuda_host_free": [_P],
            "fkv_cuda_memcpy": [_P, _P, _I64],
            "fkv_cuda_time_memcpy": [_P, _P, _I64, _I32, ctypes.POINTER(ctypes.c_double)],
        }
        for name, argtypes in sig.items():
            fn = getattr(self.lib, name)
            fn.argtypes = argtypes
            fn.restype = ctypes.c_int
        self.lib.fkv_cuda_last_error.restype = ctypes.c_char_p

    def _call(self, name: str, *args) -> None:
        if getattr(self.lib, name)(*args) != 0:
            raise CudaError(f"{name}: {self.lib.fkv_cuda_last_error().decode()}")

    def device_count(self) -> int:
        count = _I32(0)
        try:
            self._call("fkv_cuda_device_count", ctypes.byref(count))
        except CudaError:
            return 0  # no driver or no device: the caller skips GPU work
        return count.value

    def malloc(self, nbytes: int) -> int:
        ptr = _P()
        self._call("fkv_cuda_malloc", ctypes.byref(ptr), nbytes)
        return ptr.value

    def free(self, ptr: int) -> None:
        self._call("fkv_cuda_free", ptr)

    def host_alloc(self, nbytes: int) -> int:
        ptr = _P()
        self._call("fkv_cuda_host_alloc", ctypes.byref(ptr), nbytes)
        return ptr.value

    def host_free(self, ptr: int) -> None:
        self._call("fkv_cuda_host_free", ptr)

    def host_register(self, ptr: int, nbytes: int) -> None:
        self._call("fkv_cuda_host_register", ptr, nbytes)

    def host_unregister(self, ptr: int) -> None:
        self._call("fkv_cuda_host_unregister", ptr)

    def memcpy(self, dst: int, src: int, nbytes: int) -> None:
        self._call("fkv_cuda_memcpy", dst, src, nbytes)

    def time_memcpy(self, dst: int, src: int, nbytes: int, reps: int = 5) -> float:
        seconds = ctypes.c_double(0.0)
        self._call("fkv_cuda_time_memcpy", dst, src, nbytes, reps, ctypes.byref(seconds))
        return seconds.value

    def wait(self) -> None:
        self._call("fkv_cuda_wait")

    def swap(self, dev_k: list[int], dev_v: list[int], host: int, page_bytes: int, num_dev_blocks: int,
             num_host_blocks: int, src: np.ndarray, dst: np.ndarray, *, to_host: bool,
             dma_min_bytes: int = 2 << 20, sync: bool = True) -> None:
        """One fkv_cuda_swap call; pointers are ints (device pointers, a pinned host pointer)."""
        src, dst, k_arr, v_arr, layers = _swap_args(dev_k, dev_v, src, dst)
        self._call("fkv_cuda_swap", k_arr, v_arr, layers, host, page_bytes, num_dev_blocks, num_host_blocks,
                   src.ctypes.data, dst.ctypes.data, len(src), int(to_host), dma_min_bytes, None, int(sync))

    def swap_landed(self, dev_k: list[int], dev_v: list[int], host: int, page_bytes: int, num_dev_blocks: int,
                    num_host_blocks: int, src: np.ndarray, dst: np.ndarray, *, unit_bytes: int,
                    on_landed, dma_min_bytes: int = 2 << 20) -> None:
        """One fkv_cuda_swap_landed call (a SWAP_OUT): ``on_landed(pairs)`` gets each unit's pair
        indices (a list) once its bytes are in host memory."""
        src, dst, k_arr, v_arr, layers = _swap_args(dev_k, dev_v, src, dst)
        callback = LANDED_FN(lambda _ctx, pairs, count: on_landed([pairs[i] for i in range(count)]))
        self._call("fkv_cuda_swap_landed", k_arr, v_arr, layers, host, page_bytes, num_dev_blocks, num_host_blocks,
                   src.ctypes.data, dst.ctypes.data, len(src), dma_min_bytes, None, unit_bytes, callback, None)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastkv.kernels.cuda_abi",
                                     description="Build the C ABI library of ops/swap_cuda.cu with nvcc.")
    parser.add_argument("--out", type=Path, required=True, help="directory for libfkv_swap_cuda.so")
    parser.add_argument("--werror", action="store_true", help="every warning fails the build")
    args = parser.parse_args(argv)
    try:
        path = build(args.out, warnings_as_errors=args.werror)
    except (FileNotFoundError, RuntimeError, ValueError) as exc:
        print(f"fastkv.kernels.cuda_abi: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())


def _swap_args(dev_k: list[int], dev_v: list[int], src: np.ndarray, dst: np.ndarray) -> tuple:
    """The block pairs as contiguous int32 arrays and the per-layer K and V pointer arrays (no V:
    an MLA tier, passed as a null V array)."""
    src = np.ascontiguousarray(src, dtype=np.int32)
    dst = np.ascontiguousarray(dst, dtype=np.int32)
    if len(src) != len(dst) or (dev_v and len(dev_k) != len(dev_v)):
        raise ValueError(f"need equal lengths: {len(src)} src, {len(dst)} dst, {len(dev_k)} K, {len(dev_v)} V")
    layers = len(dev_k)
    return src, dst, (_P * layers)(*dev_k), (_P * layers)(*dev_v) if dev_v else None, layers

"""Thin wrappers over fastkv's compiled Paddle ops, and numpy references of them.

The ops live in ``ops/`` (C++ and CUDA sources). They are loaded, in this order, from

1. ``fastkv/_prebuilt/fastkv_ops.so`` when its ``TAG`` matches the sources (``setup.py`` and
   ``python -m fastkv.ops build --dest fastkv/_prebuilt`` put it there);
2. the build cache ``$FASTKV_OPS_CACHE`` (default ``~/.cache/fastkv/ops``), under a directory
   named by the hash of the sources, Paddle's version and the CUDA flag; missing, it is built
   just in time (about 15 s), under a file lock so concurrent processes build it once.

Paddle is imported lazily: ``import fastkv.ops`` works without it; the first op call
raises ImportError naming the package to install.
"""
from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import platform
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

OPS_DIR = Path(__file__).resolve().parent.parent / "ops"
PREBUILT_DIR = Path(__file__).resolve().parent / "_prebuilt"
LIB_NAME = "fastkv_ops"
_CPU_SOURCES = ("swap_op.cc",)
_CUDA_SOURCES = ("swap_cuda.cu",)
_HEADERS = ("swap_common.h", "swap_cuda.h")
_CXX_FLAGS = ["-O3", "-pthread"]
_CUDA_FLAGS = ["-O3", "-DFASTKV_WITH_CUDA"]

# Runs of consecutive blocks moving at least this many bytes per layer go to the DMA engines as
# one 2D copy; shorter ones to the gather kernel (GPU only; see ops/swap_cuda.cu).
DEFAULT_DMA_MIN_BYTES = 2 << 20

_loaded_from: Path | None = None


def _paddle() -> Any:
    try:
        import paddle
    except ImportError as exc:
        raise ImportError(
            "fastkv's ops need Paddle: install `fastkv[cpu]` (pip install -e '.[cpu]') on a CPU machine, "
            "or paddlepaddle-gpu on a GPU machine"
        ) from exc
    return paddle


def _with_cuda() -> bool:
    return bool(_paddle().is_compiled_with_cuda())


def _source_files(with_cuda: bool) -> list[Path]:
    names = _CPU_SOURCES + _HEADERS + (_CUDA_SOURCES if with_cuda else ())
    return [OPS_DIR / name for name in names]


def build_tag() -> str:
    """Hash of everything that changes the built library: sources, flags, Paddle, Python, CPU."""
    paddle = _paddle()
    with_cuda = _with_cuda()
    digest = hashlib.sha256()
    for path in _source_files(with_cuda):
        digest.update(path.name.encode() + b"\0" + path.read_bytes() + b"\0")
    context = (paddle.__version__, with_cuda, sys.version_info[:2], platform.machine(), _CXX_FLAGS, _CUDA_FLAGS)
    digest.update(repr(context).encode())
    return digest.hexdigest()[:20]


def cache_root() -> Path:
    env = os.environ.get("FASTKV_OPS_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "fastkv" / "ops"


def _prebuilt_library(tag: str | None) -> Path | None:
    lib = PREBUILT_DIR / f"{LIB_NAME}.so"
    tag_file = PREBUILT_DIR / "TAG"
    if not lib.is_file() or not tag_file.is_file():
        return None
    # Without sources (an installed wheel) the prebuilt library is the only one there is.
    if tag is None or tag_file.read_text().strip() == tag:
        return lib
    return None


def build(dest: Path | None = None, verbose: bool = False) -> Path:
    """Builds the ops library unless it is already there; returns its path.

    dest: a directory that receives ``fastkv_ops.so`` and ``TAG`` (for ``fastkv/_prebuilt``);
    default: the build cache. Safe to call from many processes at once.
    """
    if not OPS_DIR.is_dir():
        raise FileNotFoundError(f"fastkv's op sources are not at {OPS_DIR}; reinstall fastkv from a source checkout")
    tag = build_tag()
    root = Path(dest) if dest is not None else cache_root() / tag
    lib = root / f"{LIB_NAME}.so"
    if (root / "TAG").is_file() and (root / "TAG").read_text().strip() == tag and lib.is_file():
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        if (root / "TAG").is_file() and (root / "TAG").read_text().strip() == tag and lib.is_file():
            return lib
        _compile(root, tag, verbose)
    return lib


def _compile(root: Path, tag: str, verbose: bool) -> None:
    global _loaded_from
    from paddle.utils.cpp_extension import load as jit_load

    with_cuda = _with_cuda()
    scratch = root / f".build-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    sources = [str(OPS_DIR / name) for name in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    cxx_flags = _CXX_FLAGS + (["-DFASTKV_WITH_CUDA"] if with_cuda else [])
    try:
        jit_load(
            name=LIB_NAME,
            sources=sources,
            extra_cxx_cflags=cxx_flags,
            extra_cuda_cflags=list(_CUDA_FLAGS),
            extra_include_paths=[str(OPS_DIR)],
            build_directory=str(scratch),
            verbose=verbose,
        )
        # Rename into place so a reader never maps a half-written library.
        os.replace(scratch / LIB_NAME / f"{LIB_NAME}.so", root / f"{LIB_NAME}.so")
        (root / "TAG").write_text(tag + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    # jit_load registered the ops in this process already.
    if _loaded_from is None:
        _loaded_from = root / f"{LIB_NAME}.so"


def load() -> Path:
    """Registers the ops in this process (building them first if needed); returns the library path."""
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    paddle = _paddle()
    tag = build_tag() if OPS_DIR.is_dir() else None
    lib = _prebuilt_library(tag)
    if lib is None:
        lib = build()
    if _loaded_from is None:  # build() may have registered them already
        paddle.utils.cpp_extension.load_op_meta_info_and_register_op(str(lib))
        _loaded_from = lib
    return _loaded_from


def default_num_threads() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0))


def _ids(ids: Any, what: str) -> np.ndarray:
    paddle = _paddle()
    if isinstance(ids, paddle.Tensor):
        ids = ids.numpy()
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.empty(0, np.int32)
    if arr.dtype.kind not in "iu":
        raise TypeError(f"{what} ids must be integers, got dtype {arr.dtype}")
    if arr.ndim != 1:
        raise ValueError(f"{what} ids must be 1-D, got shape {arr.shape}")
    # Checked before the cast: a wrapped int64 would look like a valid id.
    if arr.min() < 0 or arr.max() > np.iinfo(np.int32).max:
        bad = arr[(arr < 0) | (arr > np.iinfo(np.int32).max)][0]
        raise ValueError(f"{what} id {int(bad)} is out of range")
    return np.ascontiguousarray(arr, dtype=np.int32)


def _check_tensors(k_caches: Sequence[Any], v_caches: Sequence[Any], host: Any) -> tuple[list[Any], list[Any]]:
    paddle = _paddle()
    k_list, v_list = list(k_caches), list(v_caches)
    for name, group in (("k_caches", k_list), ("v_caches", v_list), ("host", [host])):
        for i, t in enumerate(group):
            if not isinstance(t, paddle.Tensor):
                raise TypeError(f"{name}[{i}] must be a paddle.Tensor, got {type(t).__name__}")
            # Paddle hands a custom op a contiguous copy of a strided view, so an in-place write
            # would silently land in the copy: refuse instead.
            if not t.is_contiguous():
                raise ValueError(f"{name}[{i}] must be contiguous (a strided view would be copied, not written)")
    return k_list, v_list


def swap_blocks(
    k_caches: Sequence[Any],
    v_caches: Sequence[Any],
    host: Any,
    src: Any,
    dst: Any,
    *,
    to_host: bool,
    num_threads: int | None = None,
    dma_min_bytes: int = DEFAULT_DMA_MIN_BYTES,
) -> None:
    """Copies block ``src[i]`` to block ``dst[i]`` for every i, all layers, K and V, in one op call.

    k_caches, v_caches: per layer, the device tier's ``[dev_blocks, kv_heads, block_size,
    head_dim]`` tensors. host: the host tier ``[host_blocks, layers, 2, kv_heads, block_size,
    head_dim]``. to_host=True: src are device block ids, dst host block ids (SWAP_OUT); False:
    the reverse (SWAP_IN). src/dst: 1-D integer arrays (numpy, lists or paddle tensors) of
    equal length; dst ids must be unique. num_threads: CPU threads (default: every core this
    process may use). Returns when the bytes are in place (GPU: after the completion event).
    Raises TypeError/ValueError naming the bad argument before anything is copied.
    """
    paddle = _paddle()
    load()
    k_list, v_list = _check_tensors(k_caches, v_caches, host)
    src_ids, dst_ids = _ids(src, "src"), _ids(dst, "dst")
    if len(src_ids) != len(dst_ids):
        raise ValueError(f"got {len(src_ids)} src ids but {len(dst_ids)} dst ids")
    threads = default_num_threads() if num_threads is None else num_threads
    if not isinstance(threads, int) or isinstance(threads, bool) or threads < 1:
        raise ValueError(f"num_threads must be a positive int, got {num_threads!r}")
    from paddle.utils.dlpack import from_dlpack

    src_t, dst_t = from_dlpack(src_ids), from_dlpack(dst_ids)  # zero-copy: the op reads the ids in place
    try:
        paddle._C_ops._run_custom_op(
            "fastkv_swap_blocks", k_list, v_list, host, src_t, dst_t, bool(to_host), threads, int(dma_min_bytes)
        )
    except OSError as exc:  # how Paddle surfaces PD_CHECK
        message = str(exc)
        if "fastkv_swap_blocks: " not in message:
            raise
        raise ValueError(message.split("fastkv_swap_blocks: ", 1)[1].split("\n", 1)[0].strip()) from None


def swap_out(k_caches, v_caches, host, device_ids, host_ids, **kwargs) -> None:
    """Device blocks ``device_ids[i]`` -> host blocks ``host_ids[i]`` (a SWAP_OUT plan)."""
    swap_blocks(k_caches, v_caches, host, device_ids, host_ids, to_host=True, **kwargs)


def swap_in(k_caches, v_caches, host, host_ids, device_ids, **kwargs) -> None:
    """Host blocks ``host_ids[i]`` -> device blocks ``device_ids[i]`` (a SWAP_IN plan)."""
    swap_blocks(k_caches, v_caches, host, host_ids, device_ids, to_host=False, **kwargs)


def pin_host(host: Any, pin: bool = True) -> None:
    """cudaHostRegister (pin=True) or unregister the host tier's memory. GPU builds only."""
    paddle = _paddle()
    if not _with_cuda():
        raise RuntimeError("pin_host needs a CUDA build of Paddle")
    load()
    try:
        paddle._C_ops._run_custom_op("fastkv_pin_host", host, bool(pin))
    except OSError as exc:
        raise RuntimeError(str(exc).split("\n", 1)[0]) from None


# ---- numpy references (what the tests hold the ops to) ----


def swap_blocks_ref(
    k_caches: Sequence[np.ndarray],
    v_caches: Sequence[np.ndarray],
    host: np.ndarray,
    src: Sequence[int],
    dst: Sequence[int],
    *,
    to_host: bool,
) -> None:
    """The op's meaning, one block of one layer at a time."""
    for s, d in zip(src, dst, strict=True):
        for layer, (k, v) in enumerate(zip(k_caches, v_caches, strict=True)):
            if to_host:
                host[d, layer, 0] = k[s]
                host[d, layer, 1] = v[s]
            else:
                k[d] = host[s, layer, 0]
                v[d] = host[s, layer, 1]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastkv.ops", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the ops library (into the cache, or --dest)")
    b.add_argument("--dest", type=Path, default=None, help="e.g. fastkv/_prebuilt")
    b.add_argument("--verbose", action="store_true")
    sub.add_parser("where", help="print the library path this process would load")
    args = parser.parse_args(argv)
    if args.command == "build":
        print(build(args.dest, verbose=args.verbose))
    else:
        print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())

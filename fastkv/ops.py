"""Thin wrappers over fastkv's compiled Paddle ops, and numpy references of them.

The ops live in ``ops/`` (C++ and CUDA sources). They are loaded, in this order, from

1. ``fastkv/_prebuilt/fastkv_ops.so`` when its ``TAG`` matches the sources (``setup.py`` and
   ``python -m fastkv.ops build --dest fastkv/_prebuilt`` put it there);
2. the build cache ``$FASTKV_OPS_CACHE`` (default ``~/.cache/fastkv/ops``), under a directory
   named by the hash of the sources, Paddle's version and the CUDA flag; missing, it is built
   (about 15 s), under a file lock so concurrent processes build it once.

``fastkv-supervisor`` builds them before it starts any process (``find``/``build``); a transfer
process loads them before it reports ready. The compiler runs in a build process of its own
process group that dies with the building process and takes the compilers with it; the
scratch directory ``.build-<pid>`` goes on any exit, and a build sweeps those of dead pids.

Paddle is imported lazily: ``import fastkv.ops`` works without it; the first op call
raises ImportError naming the package to install.
"""
from __future__ import annotations

import argparse
import ctypes
import fcntl
import hashlib
import os
import platform
import shutil
import signal
import subprocess
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

_PR_SET_CHILD_SUBREAPER = 36
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


def _built(root: Path, tag: str) -> Path | None:
    lib = root / f"{LIB_NAME}.so"
    tag_file = root / "TAG"
    return lib if tag_file.is_file() and tag_file.read_text().strip() == tag and lib.is_file() else None


def find() -> Path | None:
    """The library ``load`` would register without building (prebuilt or cached), or None."""
    tag = build_tag() if OPS_DIR.is_dir() else None
    return _prebuilt_library(tag) or (_built(cache_root() / tag, tag) if tag else None)


def build(dest: Path | None = None, verbose: bool = False) -> Path:
    """Builds the ops library unless it is already there; returns its path.

    dest: a directory that receives ``fastkv_ops.so`` and ``TAG`` (for ``fastkv/_prebuilt``);
    default: the build cache. Safe to call from many processes at once.
    """
    if not OPS_DIR.is_dir():
        raise FileNotFoundError(f"fastkv's op sources are not at {OPS_DIR}; reinstall fastkv from a source checkout")
    tag = build_tag()
    root = Path(dest) if dest is not None else cache_root() / tag
    lib = _built(root, tag)
    if lib is not None:
        return lib
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes, also if this process dies
        lib = _built(root, tag)
        if lib is None:
            _sweep_scratch(root)
            _compile(root, tag, verbose)
            lib = root / f"{LIB_NAME}.so"
    return lib


def _sweep_scratch(root: Path) -> None:
    """Removes the scratch directories of builds whose process died (SIGKILL leaves them)."""
    from fastkv.ipc.peers import pid_alive

    for scratch in root.glob(".build-*"):
        pid = scratch.name.removeprefix(".build-")
        if not pid.isdigit() or not pid_alive(int(pid)):
            shutil.rmtree(scratch, ignore_errors=True)


def _compile(root: Path, tag: str, verbose: bool) -> None:
    scratch = root / f".build-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        _run_build_process(scratch, verbose)
        # Rename into place so a reader never maps a half-written library.
        os.replace(scratch / LIB_NAME / f"{LIB_NAME}.so", root / f"{LIB_NAME}.so")
        (root / "TAG").write_text(tag + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def _run_build_process(scratch: Path, verbose: bool) -> None:
    """Compiles into ``scratch`` through a watchdog process (``_watch_build``); on an exception
    here (Ctrl-C, the supervisor's SIGTERM) asks the watchdog to kill the compilers and waits."""
    # Its own process group: a terminal's Ctrl-C reaches only this process, which then stops it.
    proc = subprocess.Popen(_ops_command("_watch-build", scratch, os.getpid(), verbose=verbose), env=_ops_env(),
                            process_group=0, text=True,
                            stdout=None if verbose else subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate()
    finally:
        if proc.returncode is None:
            proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        tail = "\n".join((output or "").strip().splitlines()[-20:])
        raise RuntimeError(f"building fastkv's ops failed (exit {proc.returncode}):\n{tail}")


def _ops_command(command: str, *args: Any, verbose: bool) -> list[str]:
    return [sys.executable, "-m", "fastkv.ops", command, *map(str, args)] + (["--verbose"] if verbose else [])


def _ops_env() -> dict[str, str]:
    """This process's environment, with this fastkv first on the path (setup.py runs from a checkout)."""
    package_parent = str(Path(__file__).resolve().parent.parent)
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}


class _Abort(Exception):
    pass


def _watch_build(scratch: Path, parent_pid: int, verbose: bool) -> int:
    """The watchdog: runs ``_compile_into`` in a process group of its own; when the builder dies
    (PR_SET_PDEATHSIG) or terminates it, kills that group, reaps every compiler and removes ``scratch``."""
    from fastkv.ipc.peers import die_with_parent

    def abort(*_: Any) -> None:
        raise _Abort

    signal.signal(signal.SIGTERM, abort)
    die_with_parent(parent_pid, signal.SIGTERM)
    # Orphaned compilers become this process's children, so it can wait for the last one.
    if ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER) failed")
    proc = None
    try:
        proc = subprocess.Popen(_ops_command("_compile-into", scratch, verbose=verbose), process_group=0)
        return proc.wait()
    except _Abort:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if proc is not None:
            os.killpg(proc.pid, signal.SIGKILL)
        while True:
            try:
                os.wait()
            except ChildProcessError:
                break
        shutil.rmtree(scratch, ignore_errors=True)
        return 1


def _compile_into(scratch: Path, verbose: bool) -> None:
    from paddle.utils.cpp_extension import load as jit_load

    with_cuda = _with_cuda()
    sources = [str(OPS_DIR / name) for name in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    cxx_flags = _CXX_FLAGS + (["-DFASTKV_WITH_CUDA"] if with_cuda else [])
    jit_load(
        name=LIB_NAME,
        sources=sources,
        extra_cxx_cflags=cxx_flags,
        extra_cuda_cflags=list(_CUDA_FLAGS),
        extra_include_paths=[str(OPS_DIR)],
        build_directory=str(scratch),
        verbose=verbose,
    )


def load() -> Path:
    """Registers the ops in this process (building them first if needed); returns the library path."""
    global _loaded_from
    if _loaded_from is not None:
        return _loaded_from
    paddle = _paddle()
    lib = find() or build()
    paddle.utils.cpp_extension.load_op_meta_info_and_register_op(str(lib))
    _loaded_from = lib
    return lib


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
    # the processes build() runs; not for users
    watch, compile_into = sub.add_parser("_watch-build"), sub.add_parser("_compile-into")
    for step in (watch, compile_into):
        step.add_argument("scratch", type=Path)
        step.add_argument("--verbose", action="store_true")
    watch.add_argument("parent_pid", type=int)
    args = parser.parse_args(argv)
    if args.command == "_watch-build":
        return _watch_build(args.scratch, args.parent_pid, args.verbose)
    if args.command == "_compile-into":
        _compile_into(args.scratch, args.verbose)
    elif args.command == "build":
        print(build(args.dest, verbose=args.verbose))
    else:
        print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())

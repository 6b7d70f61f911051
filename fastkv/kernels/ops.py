"""Thin wrappers over fastkv's compiled Paddle ops, and numpy references of them.

The ops live in ``ops/`` (C++ and CUDA sources). They are loaded, in this order, from

1. ``fastkv/_prebuilt/fastkv_ops.so`` when its ``TAG`` matches the sources (``setup.py`` and
   ``python -m fastkv.kernels.ops build --dest fastkv/_prebuilt`` put it there);
2. the build cache ``$FASTKV_OPS_CACHE`` (default ``~/.cache/fastkv/ops``), under a directory
   named by the hash of the sources, Paddle's version and the CUDA flag; missing, it is built
   (about 15 s), under a file lock so concurrent processes build it once.

``fastkv-supervisor`` builds them before it starts any process (``find``/``build``); a transfer
process loads them before it reports ready. The compiler runs in a build process of its own
process group that dies with the building process and takes the compilers with it; the
scratch directory ``.build-<pid>`` goes on any exit, and a build sweeps those of dead pids.

Copy policy. Whether regular or streaming stores copy faster, and on how many threads,
depends on the machine (its memcpy, cache and memory), not on what cpuid reports: the first
``load`` on a machine measures every choice per call size with the op's own kernel
(``measure_copy_methods``, about a second) and caches the winners beside the build, as
``copy_policy.json`` under ``$FASTKV_OPS_CACHE/<build tag>``; later loads install them.

Hot path. ``BoundSwap`` checks a tier's tensors once through the op and then calls the same
CPU kernel through its C ABI (``fkv_cpu_swap``): no op dispatch and no DLPack per call, the
bulk of a small swap's cost. The Paddle op stays the public op (``swap_blocks``).

Paddle is imported lazily: ``import fastkv.kernels.ops`` works without it; the first op call
raises ImportError naming the package to install.
"""
from __future__ import annotations

import argparse
import ctypes
import faulthandler
import fcntl
import hashlib
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

import numpy as np

from fastkv.kernels import cuda_arch

OPS_DIR = Path(__file__).resolve().parents[2] / "ops"
PREBUILT_DIR = Path(__file__).resolve().parents[1] / "_prebuilt"
LIB_NAME = "fastkv_ops"
_CPU_SOURCES = ("swap_op.cc", "block_digest.cc", "block_digest_avx2.cc", "block_digest_avx512.cc")
_CUDA_SOURCES = ("swap_cuda.cu",)
_HEADERS = ("swap_common.h", "swap_cuda.h", "block_digest.h", "block_copy_hash.h", "third_party/xxhash/xxhash.h")
_CXX_FLAGS = ["-O3", "-pthread"]
_CUDA_FLAGS = ["-O3", "-DFASTKV_WITH_CUDA"]  # and the -gencode flags of fastkv.kernels.cuda_arch

# Runs of consecutive blocks moving at least this many bytes per layer go to the DMA engines as
# one 2D copy; shorter ones to the gather kernel (GPU only; see ops/swap_cuda.cu).
DEFAULT_DMA_MIN_BYTES = 2 << 20

_PR_SET_CHILD_SUBREAPER = 36
_loaded_from: Path | None = None
_cpu_lib: ctypes.CDLL | None = None
_cpu_lib_gil: ctypes.PyDLL | None = None  # the same library, called holding the GIL (``c_abi(hold_gil=True)``)

# Call sizes the copy policy is measured at (each entry covers calls up to the next size), and
# the synthetic tiers it is measured on: 32 KiB pages, one layer, arenas several times larger
# than the biggest call so that most of what a call touches is not in the cache, as in a real
# host tier.
CALIBRATION_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20)
_CAL_PAGE = 32 << 10
_CAL_BLOCKS = 4096
POLICY_FILE = "copy_policy.json"


def _paddle() -> Any:
    try:
        import paddle
    except ImportError as exc:
        raise ImportError(
            "fastkv's ops need Paddle: install `fastkv[cpu]` (pip install -e '.[cpu]') on a CPU machine, "
            "or paddlepaddle-gpu on a GPU machine"
        ) from exc
    return paddle


def default_fatal_signals() -> None:
    """Imports Paddle and takes back the signal handlers it installed: its C++ handler answers
    SIGTERM with a stack dump made of calls that are not async-signal-safe, so a SIGTERM at the
    wrong moment hung a transfer process until SIGKILL. A fastkv child that the supervisor
    SIGTERMs dies at once (the default); crashes are reported by Python's faulthandler."""
    _paddle().disable_signal_handler()
    faulthandler.enable()


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
    cuda_flags = _cuda_cflags() if with_cuda else _CUDA_FLAGS
    context = (paddle.__version__, with_cuda, sys.version_info[:2], platform.machine(), _CXX_FLAGS, cuda_flags)
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


def _compile(root: Path, tag: str | None, verbose: bool, cuda: bool = False, log: IO[str] | None = None) -> None:
    scratch = root / f".build-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    try:
        _run_build_process(scratch, verbose, cuda, log)
        # Rename into place so a reader never maps a half-written library.
        os.replace(scratch / LIB_NAME / f"{LIB_NAME}.so", root / f"{LIB_NAME}.so")
        if tag is not None:
            (root / "TAG").write_text(tag + "\n")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def build_gpu_variant(dest: Path, log: IO[str]) -> Path:
    """Compiles the ops with their CUDA sources into ``dest/fastkv_ops.so`` as a CUDA build of
    Paddle would, whatever this Paddle was built for, writing the compilers' commands and output
    to ``log``: the GPU build's compile check on any machine (``fastkv.kernels.gpu_build``). Needs
    $CUDA_HOME with nvcc and CUDA's headers; the result has no TAG and is not for loading."""
    dest.mkdir(parents=True, exist_ok=True)
    _compile(dest, None, True, cuda=True, log=log)
    return dest / f"{LIB_NAME}.so"


def _run_build_process(scratch: Path, verbose: bool, cuda: bool = False, log: IO[str] | None = None) -> None:
    """Compiles into ``scratch`` through a watchdog process (``_watch_build``); on an exception
    here (Ctrl-C, the supervisor's SIGTERM) asks the watchdog to kill the compilers and waits.
    cuda: with the CUDA sources even if this Paddle has no CUDA; log: where the output goes."""
    # Its own process group: a terminal's Ctrl-C reaches only this process, which then stops it.
    command = _ops_command("_watch-build", scratch, os.getpid(), verbose=verbose) + (["--cuda"] if cuda else [])
    stdout = log if log is not None else None if verbose else subprocess.PIPE
    proc = subprocess.Popen(command, env=_ops_env(), process_group=0, text=True, stdout=stdout,
                            stderr=subprocess.STDOUT)
    try:
        output, _ = proc.communicate()
    finally:
        if proc.returncode is None:
            proc.terminate()
            proc.wait()
    if proc.returncode != 0:
        tail = "\n".join((output or "").strip().splitlines()[-20:])
        where = f" (its output: {log.name})" if log is not None else ""
        raise RuntimeError(f"building fastkv's ops failed (exit {proc.returncode}){where}:\n{tail}")


def _ops_command(command: str, *args: Any, verbose: bool) -> list[str]:
    return [sys.executable, "-m", "fastkv.kernels.ops", command, *map(str, args)] + (["--verbose"] if verbose else [])


def _ops_env() -> dict[str, str]:
    """This process's environment, with this fastkv first on the path (setup.py runs from a checkout)."""
    package_parent = str(Path(__file__).resolve().parents[2])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_parent, os.environ.get("PYTHONPATH")]))}


class _Abort(Exception):
    pass


def _watch_build(scratch: Path, parent_pid: int, verbose: bool, cuda: bool = False) -> int:
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
        command = _ops_command("_compile-into", scratch, verbose=verbose) + (["--cuda"] if cuda else [])
        proc = subprocess.Popen(command, process_group=0)
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


def _cuda_cflags() -> list[str]:
    """nvcc's flags for swap_cuda.cu: Paddle's JIT adds no -gencode of its own."""
    return [*_CUDA_FLAGS, *cuda_arch.gencode_flags()]


def _compile_into(scratch: Path, verbose: bool, cuda: bool = False) -> None:
    """Paddle's JIT build of the ops into ``scratch``; with the CUDA sources where Paddle has
    CUDA, or where ``cuda`` asks for them (a compile check on a machine without)."""
    from paddle.utils.cpp_extension import load as jit_load

    with_cuda = cuda or _with_cuda()
    sources = [str(OPS_DIR / name) for name in _CPU_SOURCES + (_CUDA_SOURCES if with_cuda else ())]
    cxx_flags = _CXX_FLAGS + (["-DFASTKV_WITH_CUDA"] if with_cuda else [])
    jit_load(
        name=LIB_NAME,
        sources=sources,
        extra_cxx_cflags=cxx_flags,
        extra_cuda_cflags=_cuda_cflags() if with_cuda else list(_CUDA_FLAGS),
        extra_include_paths=[str(OPS_DIR)],
        build_directory=str(scratch),
        verbose=verbose,
    )


def load() -> Path:
    """Registers the ops in this process (building them first if needed) and installs the
    machine's copy policy (measuring it first if needed); returns the library path."""
    global _loaded_from, _cpu_lib, _cpu_lib_gil
    if _loaded_from is not None:
        return _loaded_from
    paddle = _paddle()
    lib = find() or build()
    paddle.utils.cpp_extension.load_op_meta_info_and_register_op(str(lib))
    _cpu_lib = _bind_c_abi(ctypes.CDLL(str(lib)))  # the same dlopen handle: one policy for op and ABI
    _cpu_lib_gil = _bind_c_abi(ctypes.PyDLL(str(lib)))
    _loaded_from = lib
    set_copy_policy(cached_copy_policy())
    return lib


def _bind_c_abi(lib: ctypes.CDLL) -> ctypes.CDLL:
    i32, i64, ptr = ctypes.c_int32, ctypes.c_int64, ctypes.c_void_p
    lib.fkv_cpu_swap.argtypes = [ptr, ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, i32, i32, i32, ptr]
    lib.fkv_cpu_swap_in_layer.argtypes = [ptr, ptr, i64, i64, ptr, i64, i64, i64, ptr, ptr, i64, i32]
    lib.fkv_cpu_block_checksums.argtypes = [ptr, i64, i64, i64, ptr, i64, ptr]
    lib.fkv_cpu_set_fused_checksums.argtypes = [i32]
    lib.fkv_cpu_set_copy_policy.argtypes = [i32, ptr, ptr, ptr]
    lib.fkv_cpu_copy_choice.argtypes = [i64, i32, ctypes.POINTER(i32), ctypes.POINTER(i32)]
    lib.fkv_cpu_copy_choice.restype = None
    lib.fkv_cpu_copy_contiguous.argtypes = [ptr, ptr, i64, i32]
    lib.fkv_cpu_last_error.restype = ctypes.c_char_p
    return lib


def c_abi(hold_gil: bool = False) -> ctypes.CDLL:
    """The loaded ops library through ctypes (``fkv_cpu_*`` functions, see ops/swap_op.cc). Its
    calls release the GIL, unless ``hold_gil``: then no other thread of the process runs Python
    until they return (the transfer loop's swaps: ``fastkv.transfer.lanes``)."""
    load()
    return _cpu_lib_gil if hold_gil else _cpu_lib


# ---- copy policy: measured, cached with the build ----

Policy = list[tuple[int, bool, int]]  # (min call bytes, streaming stores, threads), min bytes ascending


def _machine_id() -> str:
    """What the measurements hold for: the CPU model and the cores this machine has."""
    model = ""
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    except OSError:
        model = "(no /proc/cpuinfo)"  # named by architecture and core count alone
    return f"{platform.machine()} {model} x{os.cpu_count()}"


def set_copy_policy(policy: Policy) -> None:
    """Installs ``policy`` in the loaded library (the op and ``BoundSwap`` both follow it)."""
    n = len(policy)
    sizes = (ctypes.c_int64 * n)(*(p[0] for p in policy))
    streaming = (ctypes.c_int32 * n)(*(int(p[1]) for p in policy))
    threads = (ctypes.c_int32 * n)(*(p[2] for p in policy))
    lib = c_abi()
    if lib.fkv_cpu_set_copy_policy(n, sizes, streaming, threads) != 0:
        raise ValueError(f"bad copy policy {policy}: {lib.fkv_cpu_last_error().decode()}")


def copy_choice(nbytes: int, max_threads: int) -> tuple[bool, int]:
    """(streaming, threads) a swap of ``nbytes`` with at most ``max_threads`` threads uses now."""
    streaming, threads = ctypes.c_int32(), ctypes.c_int32()
    c_abi().fkv_cpu_copy_choice(nbytes, max_threads, ctypes.byref(streaming), ctypes.byref(threads))
    return bool(streaming.value), threads.value


def set_fused_checksums(mode: int) -> int:
    """How a CPU SWAP_OUT hashes its pages, for tests and benchmarks to compare: 1 in the copy's
    pass (the default), 2 the same with the AVX2 build, 0 each page after its copy. Returns the
    previous mode; ValueError where this CPU has no such build."""
    was = c_abi().fkv_cpu_set_fused_checksums(mode)
    if was < 0:
        raise ValueError(f"fused checksums mode {mode}: this CPU has no such build (modes 0, 1, 2)")
    return was


def _thread_counts(max_threads: int) -> list[int]:
    return sorted({t for t in (1, 2, 4, 8, 16, 32, 64) if t < max_threads} | {max_threads})


def _page_aligned_ones(shape: tuple[int, int]) -> np.ndarray:
    """Ones on a page boundary, as the tiers are (shm, device memory): numpy's own buffers are
    16-byte aligned, which sends streaming copies down their unaligned path."""
    nbytes = shape[0] * shape[1]
    raw = np.ones(nbytes + 4096, np.uint8)
    start = -raw.ctypes.data % 4096
    return raw[start:start + nbytes].reshape(shape)


def measure_copy_methods(max_threads: int | None = None, sizes: Sequence[int] = CALIBRATION_SIZES,
                         ) -> dict[tuple[int, bool, int], float]:
    """Best seconds of a swap out plus a swap in of each size, per (size, streaming, threads),
    with the op's own kernel on scattered blocks. Choices take turns so that load from other
    processes hits them alike."""
    max_threads = max_threads or default_num_threads()
    lib = c_abi()
    blocks = max(_CAL_BLOCKS, 2 * max(sizes) // (2 * _CAL_PAGE))
    k = _page_aligned_ones((blocks, _CAL_PAGE))  # written: every page mapped before timing
    v = _page_aligned_ones((blocks, _CAL_PAGE))
    host = _page_aligned_ones((blocks, 2 * _CAL_PAGE))
    k_ptr, v_ptr = (ctypes.c_void_p * 1)(k.ctypes.data), (ctypes.c_void_p * 1)(v.ctypes.data)
    rng = np.random.default_rng(0)
    choices = [(s, bool(m), t) for s in sizes for m in (0, 1) for t in _thread_counts(max_threads)]
    best = dict.fromkeys(choices, float("inf"))
    for rep in range(15):
        for size, streaming, threads in choices:
            if rep >= 5 and size > (1 << 20):  # big copies vary less; small ones get more turns
                continue
            n = max(1, size // (2 * _CAL_PAGE))
            dev_ids, host_ids = (rng.permutation(blocks)[:n].astype(np.int32) for _ in range(2))
            t0 = time.perf_counter()
            for to_host, src, dst in ((1, dev_ids, host_ids), (0, host_ids, dev_ids)):
                if lib.fkv_cpu_swap(k_ptr, v_ptr, 1, host.ctypes.data, _CAL_PAGE, blocks, blocks, src.ctypes.data,
                                    dst.ctypes.data, n, to_host, threads, int(streaming), None) != 0:
                    raise RuntimeError(lib.fkv_cpu_last_error().decode())
            key = (size, streaming, threads)
            best[key] = min(best[key], time.perf_counter() - t0)
    return best


def choose_policy(seconds: dict[tuple[int, bool, int], float]) -> Policy:
    """The fastest (streaming, threads) per measured size, as policy entries (adjacent equal ones merged)."""
    policy: Policy = []
    for size in sorted({key[0] for key in seconds}):
        _, streaming, threads = min((t, key[1], key[2]) for key, t in seconds.items() if key[0] == size)
        if not policy or policy[-1][1:] != (streaming, threads):
            policy.append((0 if not policy else size, streaming, threads))
    return policy


def cached_copy_policy() -> Policy:
    """This machine's copy policy for the loaded build: from its cache file, else measured now
    (once: concurrent processes wait for the first) and written there."""
    root = cache_root() / build_tag() if OPS_DIR.is_dir() else cache_root() / "prebuilt"
    path = root / POLICY_FILE
    root.mkdir(parents=True, exist_ok=True)
    with open(root / ".lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            saved = json.loads(path.read_text())
            if saved["machine"] == _machine_id():
                return [(int(b), bool(s), int(t)) for b, s, t in saved["policy"]]
        except (OSError, ValueError, KeyError, TypeError):
            pass  # none yet, another machine's, or unreadable: measure
        seconds = measure_copy_methods()
        policy = choose_policy(seconds)
        record = {"machine": _machine_id(), "policy": policy,
                  "seconds": [[*key, round(t, 7)] for key, t in sorted(seconds.items())]}
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)  # readers never see half a file
        return policy


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
    sums_addr: int = 0,
) -> None:
    """Copies block ``src[i]`` to block ``dst[i]`` for every i, all layers, K and V, in one op call.

    k_caches, v_caches: per layer, the device tier's ``[dev_blocks, kv_heads, block_size,
    head_dim]`` tensors. host: the host tier ``[host_blocks, layers, 2, kv_heads, block_size,
    head_dim]``. An MLA tier has no V: ``v_caches`` empty, k_caches the latent pages, host
    ``[host_blocks, layers, 1, ...]``. to_host=True: src are device block ids, dst host block ids (SWAP_OUT); False:
    the reverse (SWAP_IN). src/dst: 1-D integer arrays (numpy, lists or paddle tensors) of
    equal length; dst ids must be unique. num_threads: CPU threads (default: every core this
    process may use). sums_addr (a SWAP_OUT's; 0: none): the address of the host tier's
    checksums, a C-contiguous uint8 [host_blocks, 16] array the caller checked (``BoundSwap``
    does); each destination block's checksum is written there. Returns when the bytes are in
    place (GPU: after the completion event).
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
            "fastkv_swap_blocks", k_list, v_list, host, src_t, dst_t, bool(to_host), threads, int(dma_min_bytes),
            int(sums_addr)
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


class BoundSwap:
    """One tier's tensors, checked once, swapped many times: the transfer hot path.

    The op checks every tensor (shapes, dtypes, places, overlap) once, with no ids; then each
    CPU swap calls the same kernel through the C ABI with the ids' memory in place, holding
    the GIL if ``hold_gil`` (as ``c_abi``). The tensors must outlive this object (it keeps
    references). GPU tensors go through the op (it orders the copy after the tensors' stream).
    """

    def __init__(self, k_caches: Sequence[Any], v_caches: Sequence[Any], host: Any, hold_gil: bool = False) -> None:
        self._k, self._v = _check_tensors(k_caches, v_caches, host)
        self._host = host
        empty = np.empty(0, np.int32)
        swap_blocks(self._k, self._v, host, empty, empty, to_host=True)  # the op's checks; nothing moves
        self.on_gpu = bool(host.place.is_gpu_place() or self._k[0].place.is_gpu_place())
        layers = len(self._k)
        self._k_ptrs = (ctypes.c_void_p * layers)(*(t.data_ptr() for t in self._k))
        # None (a null pointer to the kernel): an MLA tier, one latent page per layer
        self._v_ptrs = (ctypes.c_void_p * layers)(*(t.data_ptr() for t in self._v)) if self._v else None
        shape = host.shape  # [blocks, layers, 2 (1: MLA), kv_heads, block_size, head_dim]
        self._geometry = (layers, host.data_ptr(), int(np.prod(shape[3:])) * host.element_size(),
                          self._k[0].shape[0], shape[0])
        self._lib = c_abi(hold_gil)
        # Ids are copied here and passed by these fixed addresses: reading an array's address
        # (``arr.ctypes.data``) costs more than the rest of a small swap's call. A call
        # with more ids than the larger tier has blocks cannot be valid (dst ids are unique)
        # and takes the general path, which reports why.
        cap = max(self._geometry[3:])
        self._src_ids, self._dst_ids = np.empty(cap, np.int32), np.empty(cap, np.int32)
        self._ids_at = (self._src_ids.ctypes.data, self._dst_ids.ctypes.data)
        self._sums: tuple[np.ndarray, int] | None = None  # the checksums array last checked, and its address

    def swap(self, src: Any, dst: Any, *, to_host: bool, num_threads: int | None = None,
             sums: np.ndarray | None = None) -> bool:
        """As ``swap_blocks`` on the bound tensors; src/dst as there (int32 arrays pass as they are).
        Not thread-safe: one caller at a time (the transfer process's swap lane).

        ``sums`` (a SWAP_OUT's): the host tier's checksums, uint8 [host blocks, 16], C-contiguous;
        the CPU kernel writes each destination's checksum, hashing each page in the copy's pass
        (``block_checksums``, ``set_fused_checksums``).
        On the GPU the op writes them, hashing each unit of blocks from the host tier as it
        lands while the next units copy. Returns whether the checksums were written."""
        sealing = sums is not None and bool(to_host)
        if self.on_gpu:
            sums_at = self._sums_address(sums, self._geometry[4]) if sealing else 0
            swap_blocks(self._k, self._v, self._host, src, dst, to_host=to_host, num_threads=num_threads,
                        sums_addr=sums_at)
            return sealing
        src, dst = _ids_fast(src, "src"), _ids_fast(dst, "dst")
        n = len(src)
        if n != len(dst):
            raise ValueError(f"got {n} src ids but {len(dst)} dst ids")
        if n <= len(self._src_ids):
            self._src_ids[:n], self._dst_ids[:n] = src, dst
            src_at, dst_at = self._ids_at
        else:
            src_at, dst_at = src.ctypes.data, dst.ctypes.data
        threads = default_num_threads() if num_threads is None else num_threads
        layers, host, page, ndev, nhost = self._geometry
        sums_at = self._sums_address(sums, nhost) if sealing else None
        if self._lib.fkv_cpu_swap(self._k_ptrs, self._v_ptrs, layers, host, page, ndev, nhost, src_at, dst_at, n,
                                  bool(to_host), threads, -1, sums_at) != 0:
            raise ValueError(self._lib.fkv_cpu_last_error().decode())
        return sealing

    def swap_in_layer(self, src: Any, dst: Any, layer: int, num_threads: int | None = None) -> None:
        """Layer ``layer`` of a SWAP_IN of host blocks ``src`` to device blocks ``dst`` (layer-wise
        loading): its K and V pages only. CPU tiers only (the CUDA op has no per-layer entry yet)."""
        if self.on_gpu:
            raise ValueError("swap_in_layer: a CUDA tier swaps whole (no per-layer CUDA entry point yet)")
        src, dst = _ids_fast(src, "src"), _ids_fast(dst, "dst")
        n = len(src)
        if n != len(dst):
            raise ValueError(f"got {n} src ids but {len(dst)} dst ids")
        threads = default_num_threads() if num_threads is None else num_threads
        layers, host, page, ndev, nhost = self._geometry
        if self._lib.fkv_cpu_swap_in_layer(self._k_ptrs, self._v_ptrs, layers, int(layer), host, page, ndev, nhost,
                                           src.ctypes.data, dst.ctypes.data, n, threads) != 0:
            raise ValueError(self._lib.fkv_cpu_last_error().decode())

    def _sums_address(self, sums: np.ndarray, nhost: int) -> int:
        """``sums``'s address, checked once per array (the transfer process passes its host
        tier's every time; checking and reading the address costs microseconds a call)."""
        if self._sums is None or self._sums[0] is not sums:
            if sums.dtype != np.uint8 or sums.shape != (nhost, 16) or not sums.flags.c_contiguous:
                raise ValueError(f"sums must be a C-contiguous uint8 [{nhost}, 16] array, "
                                 f"got {sums.dtype} {sums.shape}")
            self._sums = (sums, sums.ctypes.data)
        return self._sums[1]


def block_checksums(host: np.ndarray, ids: Sequence[int], hold_gil: bool = False) -> np.ndarray:
    """uint8 [len(ids), 16]: the checksums of host blocks ``ids`` of ``host`` (a host tier's
    array, [blocks, layers, 2, ...], C-contiguous), by the C kernel (ops/block_digest.h);
    ``fastkv.transfer.tiers.block_checksum`` is its reference. ``hold_gil``: as ``c_abi``."""
    if not host.flags.c_contiguous or host.ndim < 3:
        raise ValueError("host must be a C-contiguous host tier array [blocks, layers, 2, ...]")
    ids = _ids_fast(ids, "ids")
    out = np.empty((len(ids), 16), np.uint8)
    pages, page = host.shape[1] * host.shape[2], host[0, 0, 0].nbytes
    lib = c_abi(hold_gil)
    if lib.fkv_cpu_block_checksums(host.ctypes.data, pages, page, host.shape[0], ids.ctypes.data, len(ids),
                                   out.ctypes.data) != 0:
        raise ValueError(lib.fkv_cpu_last_error().decode())
    return out


def loaded() -> bool:
    """Whether this process has the ops library loaded (``load`` ran): no build, no Paddle import."""
    return _cpu_lib is not None


def _ids_fast(ids: Any, what: str) -> np.ndarray:
    """``ids`` as they are when already a contiguous int32 array (the C side checks the values)."""
    if isinstance(ids, np.ndarray) and ids.dtype == np.int32 and ids.ndim == 1 and ids.flags.c_contiguous:
        return ids
    return _ids(ids, what)


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
    """The op's meaning, one block of one page at a time (no V: an MLA tier)."""
    pages = [list(k_caches)] + ([list(v_caches)] if len(v_caches) else [])
    for s, d in zip(src, dst, strict=True):
        for kv, caches in enumerate(pages):
            for layer, c in enumerate(caches):
                if to_host:
                    host[d, layer, kv] = c[s]
                else:
                    c[d] = host[s, layer, kv]


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastkv.kernels.ops", description=__doc__.split("\n\n")[0])
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
        step.add_argument("--cuda", action="store_true")
    watch.add_argument("parent_pid", type=int)
    args = parser.parse_args(argv)
    if args.command == "_watch-build":
        return _watch_build(args.scratch, args.parent_pid, args.verbose, args.cuda)
    if args.command == "_compile-into":
        _compile_into(args.scratch, args.verbose, args.cuda)
    elif args.command == "build":
        print(build(args.dest, verbose=args.verbose))
    else:
        print(load())
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""GPU check of the CUDA swap, without Paddle: builds ops/swap_cuda.cu with nvcc, checks it byte for
byte against the numpy reference, and measures GPU <-> host GB/s against one large pinned copy.

Run on a GPU machine: ``python scripts/gpu_swap_check.py [--quick]``. Modes measured, each for
swap-out (device -> host) and swap-in (host -> device) of --blocks blocks, all layers, K and V:
  kernel   scattered blocks, gather kernel (the default for scattered ids)
  dma      scattered blocks, one DMA copy per page (dma_min_bytes=0)
  runs     consecutive blocks, one 2D DMA copy per layer and K/V (the coalesced path)
The ceiling is one cudaMemcpyAsync of the same bytes between device memory and pinned host memory.

With paddlepaddle-gpu installed it also checks the deployment path of a weight update
(``adopt_and_update``): per-layer K/V tensors the "model runner" allocated itself are adopted
(``DeviceTier.adopt``, CUDA IPC), a transfer process (``TaskExecutor``, its own process) swaps
blocks out of them, CLEAR with free_memory drops its mappings and releases the host tier, the
runner frees its caches (GPU memory reserved must drop) and allocates new ones, RESTORE attaches
those, and a swap-in lands in the new tensors byte for byte. The last line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fastkv.config import KVLayout  # noqa: E402
from fastkv.kernels import cuda_abi, ops  # noqa: E402

# Fraction of one large pinned cudaMemcpyAsync a mode should reach: runs of blocks go to the DMA
# engines as 2D copies; scattered blocks to the gather kernel.
GOALS = {"runs": 0.9, "kernel": 0.8}


def check_exact(lib: cuda_abi.CudaSwapLib) -> bool:
    """Random small tiers, both directions, every copy engine mix: byte-exact vs the numpy reference."""
    rng = np.random.default_rng(0)
    for head_dim in (64, 3):  # 16-byte-aligned pages (vector kernel) and odd ones (byte kernel)
        layout = KVLayout(num_layers=4, kv_heads=2, block_size=16, head_dim=head_dim, dtype="uint8")
        page = layout.page_bytes
        num_dev, num_host = 40, 32
        k = [rng.integers(0, 256, (num_dev, page), dtype=np.uint8) for _ in range(layout.num_layers)]
        v = [rng.integers(0, 256, (num_dev, page), dtype=np.uint8) for _ in range(layout.num_layers)]
        host = rng.integers(0, 256, (num_host, layout.num_layers, 2, page), dtype=np.uint8)
        dk = [lib.malloc(a.nbytes) for a in k]
        dv = [lib.malloc(a.nbytes) for a in v]
        hp = lib.host_alloc(host.nbytes)
        try:
            for to_host in (True, False):
                for dma_min in (0, 1 << 62, 4 * page):
                    for ptr, a in [*zip(dk, k, strict=True), *zip(dv, v, strict=True), (hp, host)]:
                        lib.memcpy(ptr, a.ctypes.data, a.nbytes)
                    num_src, num_dst = (num_dev, num_host) if to_host else (num_host, num_dev)
                    dst = np.concatenate([np.arange(0, 6), rng.permutation(np.arange(6, num_dst))[:12]])
                    src = np.concatenate([np.arange(20, 26), rng.integers(0, num_src, 12)])
                    ek, ev, eh = [a.copy() for a in k], [a.copy() for a in v], host.copy()
                    ops.swap_blocks_ref(ek, ev, eh, src, dst, to_host=to_host)
                    lib.swap(dk, dv, hp, page, num_dev, num_host, src, dst, to_host=to_host, dma_min_bytes=dma_min)
                    for ptr, want in [*zip(dk, ek, strict=True), *zip(dv, ev, strict=True), (hp, eh)]:
                        got = np.empty_like(want)
                        lib.memcpy(got.ctypes.data, ptr, got.nbytes)
                        if not np.array_equal(got, want):
                            print(f"MISMATCH head_dim={head_dim} to_host={to_host} dma_min_bytes={dma_min}")
                            return False
        finally:
            for ptr in (*dk, *dv):
                lib.free(ptr)
            lib.host_free(hp)
    return True


def measure(lib: cuda_abi.CudaSwapLib, blocks: int, reps: int) -> dict[str, float]:
    layout = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
    page = layout.page_bytes
    num_dev = num_host = blocks + blocks // 4
    nbytes = blocks * layout.block_bytes
    dk = [lib.malloc(num_dev * page) for _ in range(layout.num_layers)]
    dv = [lib.malloc(num_dev * page) for _ in range(layout.num_layers)]
    hp = lib.host_alloc(num_host * layout.block_bytes)
    rng = np.random.default_rng(1)
    scattered = (rng.permutation(num_dev)[:blocks], rng.permutation(num_host)[:blocks])
    consecutive = (np.arange(blocks), np.arange(blocks) + (num_host - blocks))
    results: dict[str, float] = {}
    try:
        modes = {"kernel": (scattered, ops.DEFAULT_DMA_MIN_BYTES), "dma": (scattered, 0),
                 "runs": (consecutive, ops.DEFAULT_DMA_MIN_BYTES)}
        for mode, ((dev_ids, host_ids), dma_min) in modes.items():
            for to_host in (True, False):
                src, dst = (dev_ids, host_ids) if to_host else (host_ids, dev_ids)
                best = float("inf")
                for _ in range(reps + 1):  # the first run warms up
                    start = time.perf_counter()
                    lib.swap(dk, dv, hp, page, num_dev, num_host, src, dst, to_host=to_host, dma_min_bytes=dma_min)
                    best = min(best, time.perf_counter() - start)
                results[f"{'d2h' if to_host else 'h2d'}_{mode}"] = round(nbytes / best / 1e9, 2)
        big = lib.malloc(nbytes)
        try:
            results["memcpy_d2h"] = round(nbytes / lib.time_memcpy(hp, big, nbytes, reps) / 1e9, 2)
            results["memcpy_h2d"] = round(nbytes / lib.time_memcpy(big, hp, nbytes, reps) / 1e9, 2)
        finally:
            lib.free(big)
    finally:
        for ptr in (*dk, *dv):
            lib.free(ptr)
        lib.host_free(hp)
    return results


def _transfer(spec_json: str, tasks, done) -> None:
    """The transfer side of ``adopt_and_update``, in its own process (CUDA IPC needs one)."""
    from fastkv.ipc import TaskMsg
    from fastkv.run import RunSpec
    from fastkv.transfer.executor import TaskExecutor

    spec = RunSpec.from_json(spec_json)
    ops.load()
    executor = TaskExecutor(spec, 0)
    try:
        while (task := tasks.get()) is not None:
            msg = executor.run(TaskMsg(*task))
            done.put((msg.ok, msg.error))
    finally:
        executor.close()


def adopt_and_update() -> dict | None:
    """One weight-update cycle on adopted CUDA caches (module docstring); None without paddlepaddle-gpu."""
    import multiprocessing as mp
    import uuid

    try:
        import paddle
    except ImportError:
        return None
    if not paddle.is_compiled_with_cuda() or paddle.device.cuda.device_count() == 0:
        return None
    from fastkv.cache.plan import CopyKind
    from fastkv.run import RunSpec
    from fastkv.transfer.protocol import FREE
    from fastkv.transfer.tiers import DeviceTier, HostTier, resident_bytes

    layout = KVLayout(num_layers=4, kv_heads=4, block_size=16, head_dim=128, dtype="bfloat16")
    n = 512
    spec = RunSpec(f"gpuchk{uuid.uuid4().hex[:6]}", layout, num_device_blocks=n, num_host_blocks=64)
    paddle.set_device("gpu:0")
    shape = list(layout.device_shape(n))
    k = [paddle.randint(-1000, 1000, shape).astype("bfloat16") for _ in range(layout.num_layers)]
    v = [paddle.randint(-1000, 1000, shape).astype("bfloat16") for _ in range(layout.num_layers)]
    host = HostTier.create(spec.tier_prefix, 0, layout, 64)
    tier = DeviceTier.adopt(spec.tier_prefix, 0, layout, k, v)
    ctx = mp.get_context("spawn")
    tasks, done = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=_transfer, args=(spec.to_json(), tasks, done))
    proc.start()
    out: dict = {}

    def run(kind: CopyKind, src=(), dst=(), keys=()) -> None:
        tasks.put((1, int(kind), np.asarray(src, np.int32), np.asarray(dst, np.int32), tuple(keys)))
        ok, error = done.get(timeout=120)
        assert ok, f"{kind.name} failed: {error}"

    try:
        run(CopyKind.SWAP_OUT, [3, 7], [0, 1])
        out["adopted_swap_out_exact"] = bool(np.array_equal(
            np.from_dlpack(k[1][7].cpu().view(paddle.int16)).view(np.uint16), host.array[1, 1, 0]))
        host_held = resident_bytes(host.name)
        run(CopyKind.CLEAR, keys=(FREE,))
        out["host_released_bytes"] = host_held - resident_bytes(host.name)
        held = paddle.device.cuda.memory_reserved()
        del k, v
        tier.close()
        tier.unlink()
        paddle.device.cuda.empty_cache()
        out["device_released_bytes"] = held - paddle.device.cuda.memory_reserved()
        tier = DeviceTier.create(spec.tier_prefix, 0, layout, n, backend="cuda")  # the new caches
        run(CopyKind.RESTORE, keys=(b"v2",))
        host.array[2] = 5
        host.seal([2])
        run(CopyKind.SWAP_IN, [2], [9])
        out["restored_swap_in_exact"] = bool((tier.k[0][9].cpu().astype("float32").numpy() != 0).all())
    finally:
        tasks.put(None)
        proc.join(60)
        tier.close()
        tier.unlink()
        host.close()
        host.unlink()
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--blocks", type=int, default=256)
    parser.add_argument("--build-dir", type=Path, default=None, help="where nvcc puts the library (default: temp)")
    args = parser.parse_args()
    reps = 3 if args.quick else 10
    with tempfile.TemporaryDirectory() as tmp:
        path = cuda_abi.build(args.build_dir or Path(tmp))
        lib = cuda_abi.CudaSwapLib(path)
        if lib.device_count() == 0:
            print("no CUDA device: built the library, nothing to run")
            print(json.dumps({"bench": "gpu_swap", "exact": None, "gbps": None}))
            return 2
        exact = check_exact(lib)
        gbps = measure(lib, args.blocks, reps)
    update = adopt_and_update()
    if update is None:
        print("adopt + weight update: skipped (needs paddlepaddle-gpu)")
    else:
        print(f"adopt + weight update: {update}")
        exact = exact and update["adopted_swap_out_exact"] and update["restored_swap_in_exact"]
    print(f"{args.blocks} blocks, 8 layers, K and V, 8 x 64 x 128 bf16 pages; best of {reps}")
    print(f"{'what':<16} {'GB/s':>8} {'vs memcpy':>10} {'goal':>6}")
    ratios, goals_met = {}, {}
    for name, rate in gbps.items():
        ceiling = gbps["memcpy_d2h" if name.startswith(("d2h", "memcpy_d2h")) else "memcpy_h2d"]
        ratios[name] = round(rate / ceiling, 3)
        goal = None if name.startswith("memcpy") else GOALS.get(name.split("_", 1)[1])
        if goal is not None:
            goals_met[name] = ratios[name] >= goal
        print(f"{name:<16} {rate:>8.2f} {rate / ceiling:>10.2f} {goal if goal else '':>6}")
    print(json.dumps({"bench": "gpu_swap", "exact": exact, "gbps": gbps, "vs_memcpy": ratios, "goals": GOALS,
                      "goals_met": goals_met, "weight_update": update}))
    return 0 if exact else 1


if __name__ == "__main__":
    sys.exit(main())

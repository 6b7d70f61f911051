"""Benchmark of the swap op (issue 4): one op call moving 256 scattered blocks, all layers, K and V.

Shape: 64-token blocks, 8 layers, 8 kv heads x 128 head dim, bfloat16 (2 MiB per block,
512 MiB per call), device and host tiers in POSIX shm as the CPU build shares them. Compared
with one contiguous memcpy of the same bytes (the ceiling) and with a per-(layer, block) copy
loop (FastDeploy's pattern). The op copies with the stores and threads its measured copy
policy picks (``fastkv.kernels.ops``), so it can beat libc memcpy; the ceiling is the better of two
contiguous copies of one span: libc memcpy and the op's streaming-store routine
(``gbps.memcpy_Nt``, ``gbps.stream_Nt``). Every figure is the best of --reps runs taken in
turns: other processes share the cores, and the best run is the one they disturbed least.

Task round trip: one transfer process (spawned as the supervisor starts it) on tiers of the
same shape; the engine side submits one task through ``TransferClient`` and blocks on its
inbox until the ack completes it, again and again. ``task_rtt_us`` holds the median round
trips: ``swap_out_1block`` of a 1-block SWAP_OUT (``block_bytes`` moved, host checksums
written as the run's default ``host_checksums`` has it: ``checksums`` in the JSON),
``empty_task`` of an empty task (the transfer layer's own cost), ``ipc`` of one task message
through a pair of fastkv channels and an echo process (bench_ipc's fastkv backend: the floor
the transfer path runs on), their p99s, ``copy_at_op_1t`` the block's copy time at the op's
1-thread speed and ``swap_out_extra`` what the SWAP_OUT takes beyond the empty task and that
copy (goal: at most 30 us). ``empty_task_rtt_us`` and ``ipc_rtt_us`` repeat two of them.
``gbps.swap_out_sums_fused_1t`` / ``swap_out_sums_separate_1t``: the op's 1-thread SWAP_OUT
writing host checksums, each page hashed in the copy's pass or after its copy, beside
``swap_out_1t`` writing none.

Lanes: ``lane_p99_ratio`` is the p99 of a 1-block SWAP_IN while a 64 MiB STORE to a
throttled backend (LMDB behind a 256 MB/s limit, as a remote store is slow) runs in the
same rank, over the p99 of the same SWAP_IN alone, in rounds that take turns (``lane_p99``).
With one loop per rank a SWAP_IN waits for the whole STORE; with lanes it runs beside it.

Stages: where the round trip of an empty task and of a 1-block SWAP_OUT goes, taken in turns
through one transfer process, from ``perf_counter_ns`` stamps taken in
both processes (one clock): ``submit`` (the engine's call), ``to loop`` (submit's start to the
transfer loop taking the task up: the wake-up), ``execute`` (to the start of the ack's send),
``to engine`` (to the engine's inbox returning the ack: the other wake-up; the engine may run
before the send returns) and ``complete`` (``on_done``); min and p50 of each, in us.

The last line is the issue's JSON.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import multiprocessing as mp
import os
import tempfile
import threading
import time
from contextlib import contextmanager

import numpy as np
from bench_ipc import kv_msg  # scripts/ is on the path of a script run from it

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.cli import at_least
from fastkv.config import KVLayout
from fastkv.ipc import Channel, ChannelClosed, DoneMsg, Namespace, PeerDied
from fastkv.kernels import ops
from fastkv.run import RunSpec, attach_engine, create_run
from fastkv.transfer import process
from fastkv.transfer.client import TransferClient
from fastkv.transfer.tiers import DeviceTier, HostTier


def best_seconds(fns: dict[str, object], reps: int) -> dict[str, float]:
    """Best time of each function, taking turns so that load from other processes hits all alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(reps):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


def memcpy_threads(dst: int, src: int, nbytes: int, threads: int) -> None:
    """libc memcpy split over threads (ctypes releases the GIL for the call)."""
    chunk = (nbytes + threads - 1) // threads
    parts = [(dst + i * chunk, src + i * chunk, min(chunk, nbytes - i * chunk)) for i in range(threads)]
    workers = [threading.Thread(target=ctypes.memmove, args=p) for p in parts[1:]]
    for w in workers:
        w.start()
    ctypes.memmove(*parts[0])
    for w in workers:
        w.join()


def copy_loop(device: DeviceTier, host: HostTier, src: np.ndarray, dst: np.ndarray) -> None:
    """One copy per (layer, block) and K/V, driven from Python."""
    for s, d in zip(src.tolist(), dst.tolist(), strict=True):
        for layer in range(device.layout.num_layers):
            host.array[d, layer, 0] = device.k_arrays[layer][s]
            host.array[d, layer, 1] = device.v_arrays[layer][s]


class Throttled:
    """A storage backend limited to ``bytes_per_s`` (sleeping after each batch, as a
    network round trip waits: the GIL is free meanwhile)."""

    def __init__(self, store, bytes_per_s: float) -> None:
        self.store, self.bytes_per_s = store, bytes_per_s

    def _throttle(self, t0: float, blocks: int, block_bytes: int) -> None:
        time.sleep(max(0.0, blocks * block_bytes / self.bytes_per_s - (time.perf_counter() - t0)))

    def put(self, keys, host, block_ids):
        t0 = time.perf_counter()
        out = self.store.put(keys, host, block_ids)
        self._throttle(t0, len(keys), host[0].nbytes)
        return out

    def get(self, keys, host, block_ids):
        t0 = time.perf_counter()
        out = self.store.get(keys, host, block_ids)
        self._throttle(t0, len(keys), host[0].nbytes)
        return out

    @property
    def stats(self):
        return self.store.stats

    def close(self) -> None:
        self.store.close()


def throttled_transfer_main(spec_json: str, rank: int, bytes_per_s: float) -> int:
    """transfer[rank] whose storage backend is ``Throttled``."""
    from fastkv.transfer import executor

    opened = executor.open_store
    executor.open_store = lambda *a, **kw: Throttled(opened(*a, **kw), bytes_per_s)
    return process.main(spec_json, rank)


def stamped_transfer_main(spec_json: str, rank: int, path: str) -> int:
    """transfer[rank] saving to ``path``, per task, [task id, loop took it up, ack send
    started] (``perf_counter_ns``; one clock for both processes)."""
    stamps: dict[int, list[int]] = {}
    handle, send = process.TransferLoop.handle, process.TransferLoop.send

    def stamped_handle(self, msg) -> None:
        stamps[msg.task_id] = [msg.task_id, time.perf_counter_ns()]
        handle(self, msg)

    def stamped_send(self, done) -> None:
        stamps[done.task_id].append(time.perf_counter_ns())
        send(self, done)

    process.TransferLoop.handle, process.TransferLoop.send = stamped_handle, stamped_send
    try:
        return process.main(spec_json, rank)
    finally:
        np.save(path, np.array([row for row in stamps.values() if len(row) == 3], np.int64).reshape(-1, 3))


@contextmanager
def transfer_rank(layout: KVLayout, num_host_blocks: int = 8, storage_url: str = "", bytes_per_s: float = 0.0,
                  stamps_to: str = ""):
    """(spec, ends, client) of a run with one real transfer process (spawned as the supervisor
    starts it); with ``stamps_to``, ``stamped_transfer_main`` saves its stamps there."""
    ns = Namespace.create()
    spec = RunSpec(run_id=ns.run_id, layout=layout, num_device_blocks=8, num_host_blocks=num_host_blocks,
                   ops_threads=1, storage_url=storage_url)
    tiers, proc, ends = [], None, None
    try:
        create_run(ns, spec)
        ns.record("shm", "kvdev0")
        tiers.append(DeviceTier.create(spec.tier_prefix, 0, layout, 8, backend="shm", populate=True))
        ns.record("shm", "kvhost0")
        tiers.append(HostTier.create(spec.tier_prefix, 0, layout, num_host_blocks, populate=True))
        ends = attach_engine(ns, spec)
        client = TransferClient(ends, spec)
        target, args = process.main, (spec.to_json(), 0)
        if bytes_per_s:
            target, args = throttled_transfer_main, (*args, bytes_per_s)
        elif stamps_to:
            target, args = stamped_transfer_main, (*args, stamps_to)
        proc = mp.get_context("spawn").Process(target=target, args=args, daemon=True)
        proc.start()
        deadline = time.monotonic() + 120
        while not client.ready():  # start-up (Paddle import): a benchmark may wait crudely
            if time.monotonic() > deadline or not proc.is_alive():
                raise RuntimeError("the transfer process did not come up")
            time.sleep(0.05)
        yield spec, ends, client
    finally:
        if ends is not None:
            ends.signals["stop"] = 1
        if proc is not None:
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
        if ends is not None:
            ends.close()
        for tier in tiers:
            tier.unlink()
            tier.close()
        ns.close()


def _echo(run_id: str) -> None:
    """Sends every message on channel ``a`` back on ``b`` until a negative task id."""
    ns = Namespace.attach(run_id)
    a = Channel.attach(ns, "a").bind("recv", "echo")
    b = Channel.attach(ns, "b").bind("send", "echo")
    while True:  # no timeout: a slow start of the transfer process beside it is no reason to leave
        try:
            msgs = a.recv_many(64)
        except (PeerDied, ChannelClosed):  # the bench is gone
            return
        b.send_many(msgs)
        if msgs[-1].task_id < 0:
            return


class EchoPeer:
    """fastkv channels to an echo process that blocks in ``recv_many`` as the transfer
    process does: ``ping()`` is one IPC round trip of a task message, in seconds."""

    def __init__(self) -> None:
        self.ns = Namespace.create()
        self.chans = [Channel.create(self.ns, name, slot_size=256, nslots=1024) for name in ("a", "b")]
        self.a, self.b = self.chans[0].bind("send", "engine"), self.chans[1].bind("recv", "engine")
        self.kid = mp.get_context("spawn").Process(target=_echo, args=(self.ns.run_id,), daemon=True)
        self.kid.start()
        self.n = 0
        self.ping(timeout=120)  # waits for the echo process to come up

    def ping(self, timeout: float = 10) -> float:
        self.n += 1
        t0 = time.perf_counter()
        self.a.send(kv_msg(self.n))
        got = self.b.recv_many(64, timeout=timeout)
        seconds = time.perf_counter() - t0
        assert got and got[0].task_id == self.n, \
            f"echo mismatch: sent {self.n}, got {[m.task_id for m in got]} in {seconds:.3f} s"
        return seconds

    def close(self) -> None:
        self.a.send(kv_msg(-1))
        self.kid.join(10)
        if self.kid.is_alive():
            self.kid.kill()
        for ch in self.chans:
            ch.close()
        self.ns.close()


def copy_ceilings(lib: ctypes.CDLL, dst: int, src: int, nbytes: int) -> dict[str, object]:
    """The contiguous copies of one span the op is held to, per thread count."""
    fns = {}
    for threads in (1, 2):
        fns[f"contiguous memcpy {threads}t"] = lambda t=threads: memcpy_threads(dst, src, nbytes, t)
        fns[f"contiguous stream copy {threads}t"] = lambda t=threads: lib.fkv_cpu_copy_contiguous(dst, src, nbytes, t)
    return fns


def wait_for(spec: RunSpec, ends, client: TransferClient, task_id: int, on_other=lambda res: None) -> None:
    """Blocks on the inbox until task ``task_id`` completes (ok); hands other results to ``on_other``."""
    done = False
    while not done:
        msgs = ends.inbox.recv_many(16, timeout=spec.task_timeout_s)
        if not msgs:
            raise RuntimeError("no ack within the task timeout")
        for res in (r for m in msgs if isinstance(m, DoneMsg) for r in client.on_done(m)):
            assert res.ok, res.error
            if res.plan.plan_id == task_id:
                done = True
            else:
                on_other(res)


def task_rtt(layout: KVLayout, reps: int) -> tuple[dict[str, float], bool]:
    """Round trips (us) of tasks through one real transfer process: p50/p99 of a 1-block
    SWAP_OUT and of an empty task, and of a bare IPC round trip (``EchoPeer``), taken in
    turns so that load from other processes hits all three alike; and whether the rank
    wrote host checksums (its spec's ``host_checksums``)."""
    echo = EchoPeer()
    try:
        with transfer_rank(layout) as (spec, ends, client):
            checksums = spec.host_checksums
            ids = iter(range(1, 1 << 62))

            def one(blocks: int) -> float:
                i = next(ids)  # blocks in turn: no copy finds its source in the cache from the last
                p = CopyPlan(i, CopyKind.SWAP_OUT, (np.arange(blocks) + i) % 8, (np.arange(blocks) + 3 * i) % 8)
                t0 = time.perf_counter()
                client.submit(p)
                wait_for(spec, ends, client, p.plan_id)
                return (time.perf_counter() - t0) * 1e6

            kinds = {"1-block SWAP_OUT": lambda: one(1), "empty task": lambda: one(0),
                     "IPC round trip": lambda: echo.ping() * 1e6}
            samples: dict[str, list[float]] = {name: [] for name in kinds}
            for turn in range(max(1, reps // 25) + 1):
                for name, fn in kinds.items():
                    got = [fn() for _ in range(25)]
                    if turn:  # the first turn warms up
                        samples[name] += got
    finally:
        echo.close()
    out: dict[str, float] = {}
    for name, got in samples.items():
        out[f"{name} p50"] = float(np.percentile(got, 50))
        out[f"{name} p99"] = float(np.percentile(got, 99))
    return out, checksums


def task_stages(layout: KVLayout, reps: int) -> dict[str, dict[str, tuple[float, float]]]:
    """(min, p50) in us of each stage of the round trip (module docstring) of an empty task and
    of a 1-block SWAP_OUT, taken in turns through one stamped transfer process."""
    clock = time.perf_counter_ns
    kinds = {"empty task": 0, "1-block SWAP_OUT": 1}
    with tempfile.TemporaryDirectory(prefix="fkvstages") as tmp:
        path = os.path.join(tmp, "stamps.npy")
        engine: dict[str, list[tuple[int, ...]]] = {kind: [] for kind in kinds}
        with transfer_rank(layout, stamps_to=path) as (spec, ends, client):
            for task_id in range(1, 2 * reps + 1):
                kind = list(kinds)[task_id % 2]
                blocks = kinds[kind]
                plan = CopyPlan(task_id, CopyKind.SWAP_OUT, np.arange(blocks) + task_id % 8,
                                np.arange(blocks) + task_id * 3 % 8)
                t0 = clock()
                client.submit(plan)
                t1 = clock()
                msgs = ends.inbox.recv_many(16, timeout=spec.task_timeout_s)
                t2 = clock()
                done = [r for m in msgs for r in client.on_done(m)]
                engine[kind].append((task_id, t0, t1, t2, clock()))
                assert [r.plan.plan_id for r in done] == [task_id] and done[0].ok, done
        far_all = np.load(path)  # written as the transfer process exited
    out = {}
    for kind, rows in engine.items():
        e = np.array(rows, np.int64)[reps // 5:]  # the first fifth warms up
        far = far_all[np.searchsorted(far_all[:, 0], e[:, 0])]
        stages = {"submit": e[:, 2] - e[:, 1], "to loop": far[:, 1] - e[:, 1], "execute": far[:, 2] - far[:, 1],
                  "to engine": e[:, 3] - far[:, 2], "complete": e[:, 4] - e[:, 3], "round trip": e[:, 4] - e[:, 1]}
        out[kind] = {name: (float(ns.min()) / 1e3, float(np.percentile(ns, 50)) / 1e3) for name, ns in stages.items()}
    return out


def lane_p99(layout: KVLayout, reps: int, store_bytes: int = 64 << 20, bytes_per_s: float = 256e6,
             per_round: int = 30) -> dict[str, float]:
    """p99 (us) of a 1-block SWAP_IN alone and beside a ``store_bytes`` STORE to a backend
    throttled to ``bytes_per_s``. Rounds take turns, so that load from other processes hits
    both alike: submit the STORE, ``per_round`` SWAP_INs beside it (well within its time),
    wait for it, one SWAP_IN to wake the rank (not counted), ``per_round`` SWAP_INs alone."""
    n = store_bytes // layout.block_bytes
    with tempfile.TemporaryDirectory(prefix="fkvlanes") as tmp, \
            transfer_rank(layout, n + 1, f"lmdb://{tmp}", bytes_per_s) as (spec, ends, client):
        ids = iter(range(1, 1 << 62))
        keys = tuple(i.to_bytes(32, "little") for i in range(n))
        pending: set[int] = set()

        def swap_in() -> float:
            p = CopyPlan(next(ids), CopyKind.SWAP_IN, np.array([n]), np.array([0]))
            t0 = time.perf_counter()
            client.submit(p)
            wait_for(spec, ends, client, p.plan_id, lambda res: pending.discard(res.plan.plan_id))
            return (time.perf_counter() - t0) * 1e6

        for _ in range(20):
            swap_in()  # warm-up
        alone, beside, late = [], [], 0
        for _ in range(max(1, reps // per_round)):
            store = CopyPlan(next(ids), CopyKind.STORE, np.arange(n), np.empty(0, np.int32), keys)
            client.submit(store)
            pending.add(store.plan_id)
            beside += [swap_in() for _ in range(per_round)]
            late += store.plan_id not in pending  # the STORE ended before the round did: fewer samples beside it
            if store.plan_id in pending:
                wait_for(spec, ends, client, store.plan_id)
                pending.discard(store.plan_id)
            # The rank idled while the STORE finished, and its first task pays the wake-up (~0.8 ms
            # against ~0.13 here): one such per round was the "alone" p99, which halved the ratio.
            # The samples beside the STORE find the rank awake; so must these.
            swap_in()
            alone += [swap_in() for _ in range(per_round)]
        return {"SWAP_IN alone p99": float(np.percentile(alone, 99)),
                "SWAP_IN beside the STORE p99": float(np.percentile(beside, 99)),
                "rounds where the STORE ended first": float(late)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions (well under a minute)")
    parser.add_argument("--blocks", type=at_least(1), default=256)
    parser.add_argument("--reps", type=at_least(1), default=None, help="default 20, --quick 8")
    parser.add_argument("--rtt-reps", type=at_least(1), default=None,
                        help="task round trips; default 3000, --quick 500")
    parser.add_argument("--smoke", action="store_true",
                    help="8 blocks, 1 rep, 20 round trips (tests: numbers mean nothing)")
    args = parser.parse_args()
    if args.smoke:
        args.blocks, args.reps, args.rtt_reps = 8, args.reps or 1, args.rtt_reps or 20
    reps = args.reps or (8 if args.quick else 20)
    rtt_reps = args.rtt_reps or (500 if args.quick else 3000)
    lane_reps = 20 if args.smoke else 600 if args.quick else 1500

    layout = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
    n = args.blocks
    num_dev = num_host = n + n // 4  # room to scatter
    nbytes = n * layout.block_bytes
    prefix = f"fkvbench{os.getpid()}_"
    lib = ops.c_abi()
    host = HostTier.create(prefix, 0, layout, num_host, populate=True)
    device = DeviceTier.create(prefix, 0, layout, num_dev, backend="shm", populate=True)
    try:
        rng = np.random.default_rng(0)
        for a in (*device.k_arrays, *device.v_arrays):
            a[:] = rng.integers(0, 2**16, a.shape, dtype=np.uint16)
        host.array[:] = 0
        dev_ids = rng.permutation(num_dev)[:n].astype(np.int32)
        host_ids = rng.permutation(num_host)[:n].astype(np.int32)
        runs = 1 + int(np.count_nonzero((np.diff(dev_ids) != 1) | (np.diff(host_ids) != 1)))

        def op(to_host: bool, threads: int):
            if to_host:
                return lambda: ops.swap_out(device.k, device.v, host.tensor, dev_ids, host_ids, num_threads=threads)
            return lambda: ops.swap_in(device.k, device.v, host.tensor, host_ids, dev_ids, num_threads=threads)

        op(True, 2)()  # warm up, then check the bytes once
        for i in rng.choice(n, 8, replace=False):
            for layer in range(layout.num_layers):
                assert np.array_equal(host.array[host_ids[i], layer, 0], device.k_arrays[layer][dev_ids[i]])
                assert np.array_equal(host.array[host_ids[i], layer, 1], device.v_arrays[layer][dev_ids[i]])

        # The contiguous ceiling: the same bytes, host tier span -> device segment span.
        host_base = host.array.ctypes.data
        dev_base = device.k_arrays[0].ctypes.data
        assert num_dev * layout.block_bytes >= nbytes
        fns = {}
        for threads in (1, 2):
            fns[f"op swap_out {threads}t"] = op(True, threads)
            fns[f"op swap_in {threads}t"] = op(False, threads)
        # A SWAP_OUT writing host checksums as the transfer process's does, each page hashed in
        # the copy's pass (fused) or after its copy (separate).
        bound, sums = ops.BoundSwap(device.k, device.v, host.tensor), np.zeros((num_host, 16), np.uint8)

        def sealed(mode: int):
            def run():
                ops.set_fused_checksums(mode)
                bound.swap(dev_ids, host_ids, to_host=True, num_threads=1, sums=sums)
            return run

        fns["op swap_out 1t, sums fused"] = sealed(1)
        fns["op swap_out 1t, sums separate"] = sealed(0)
        fns.update(copy_ceilings(lib, dev_base, host_base, nbytes))
        fns["per-(layer, block) loop 1t"] = lambda: copy_loop(device, host, dev_ids, host_ids)
        best = best_seconds(fns, reps)
        rows = [(name, seconds, nbytes / seconds / 1e9) for name, seconds in best.items()]
        gbps = {}
        for threads in (1, 2):
            # Both directions: bytes over the sum of the two best times.
            t_op = best[f"op swap_out {threads}t"] + best[f"op swap_in {threads}t"]
            gbps[f"op_{threads}t"] = round(2 * nbytes / t_op / 1e9, 2)
            gbps[f"memcpy_{threads}t"] = round(nbytes / best[f"contiguous memcpy {threads}t"] / 1e9, 2)
            gbps[f"stream_{threads}t"] = round(nbytes / best[f"contiguous stream copy {threads}t"] / 1e9, 2)
        gbps["loop_1t"] = round(nbytes / best["per-(layer, block) loop 1t"] / 1e9, 2)
        gbps["swap_out_1t"] = round(nbytes / best["op swap_out 1t"] / 1e9, 2)
        gbps["swap_out_sums_fused_1t"] = round(nbytes / best["op swap_out 1t, sums fused"] / 1e9, 2)
        gbps["swap_out_sums_separate_1t"] = round(nbytes / best["op swap_out 1t, sums separate"] / 1e9, 2)
        ops.set_fused_checksums(1)

        print(f"swap of {n} scattered blocks ({runs} runs), {layout.describe()}, {nbytes / 2**20:.0f} MiB per call, "
              f"best of {reps}, cores available: {len(os.sched_getaffinity(0))}")
        print(f"{'what':<30} {'ms':>9} {'GB/s':>8}")
        for name, seconds, rate in rows:
            print(f"{name:<30} {seconds * 1e3:>9.2f} {rate:>8.2f}")
        for threads in (1, 2):
            op_gbps, ceiling = gbps[f"op_{threads}t"], max(gbps[f"memcpy_{threads}t"], gbps[f"stream_{threads}t"])
            print(f"{threads} thread(s): copy policy {ops.copy_choice(nbytes, threads)} (streaming, threads); "
                  f"op / memcpy {op_gbps / gbps[f'memcpy_{threads}t']:.2f}, "
                  f"op / contiguous stream copy {op_gbps / gbps[f'stream_{threads}t']:.2f}, "
                  f"op / better contiguous copy {op_gbps / ceiling:.2f}")
        print(f"op 1t / loop 1t: {gbps['op_1t'] / gbps['loop_1t']:.2f}")
        fused, separate = (gbps[f"swap_out_sums_{how}_1t"] / gbps["swap_out_1t"] for how in ("fused", "separate"))
        print(f"swap_out 1t with host checksums / without (GB/s): fused {fused:.2f}, separate {separate:.2f}")
    finally:
        device.unlink()
        host.unlink()
    rtt, checksums = task_rtt(layout, rtt_reps)
    print(f"task round trip through a transfer process ({rtt_reps} each; engine submit -> ack completes it):")
    for name, us in rtt.items():
        print(f"  {name:<24} {us:>9.1f} us")
    empty_us, task_us, ipc_us = rtt["empty task p50"], rtt["1-block SWAP_OUT p50"], rtt["IPC round trip p50"]
    copy_us = layout.block_bytes / (gbps["op_1t"] * 1e9) * 1e6
    extra_us = task_us - empty_us - copy_us
    print(f"empty task / IPC RTT {empty_us / ipc_us:.2f} (goal <= 3); 1-block swap (host checksums "
          f"{'on' if checksums else 'off'}) - empty task - copy at op_1t ({copy_us:.0f} us) = {extra_us:.0f} us "
          "(goal <= 30)")
    stages = task_stages(layout, rtt_reps)
    print(f"stages (us; min, p50): {'':<14}" + "".join(f"{kind:>24}" for kind in stages))
    for name in stages["empty task"]:
        print(f"  {name:<34}" + "".join(f"{got[name][0]:>12.1f}{got[name][1]:>12.1f}" for got in stages.values()))
    lanes = lane_p99(layout, lane_reps)
    ratio = lanes["SWAP_IN beside the STORE p99"] / lanes["SWAP_IN alone p99"]
    print(f"lanes ({lane_reps} SWAP_INs each; a 64 MiB STORE to LMDB throttled to 256 MB/s beside them):")
    for name, us in lanes.items():
        print(f"  {name:<34} {us:>9.1f}{' us' if name.startswith('SWAP_IN') else ''}")
    print(f"  lane_p99_ratio {ratio:.2f} (at most 2)")
    rtts = {"swap_out_1block": task_us, "empty_task": empty_us, "ipc": ipc_us,
            "swap_out_1block_p99": rtt["1-block SWAP_OUT p99"], "empty_task_p99": rtt["empty task p99"],
            "copy_at_op_1t": copy_us, "swap_out_extra": extra_us}
    print(json.dumps({"bench": "swap", "gbps": gbps, "checksums": checksums,
                      "task_rtt_us": {name: round(us, 1) for name, us in rtts.items()},
                      "empty_task_rtt_us": round(empty_us, 1), "ipc_rtt_us": round(ipc_us, 1),
                      "block_bytes": layout.block_bytes, "lane_p99_ratio": round(ratio, 2)}))


if __name__ == "__main__":
    main()

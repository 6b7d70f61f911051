"""A test stand-in for the supervisor: namespace, run topology, both KV tiers of every rank,
transfer processes started with 'spawn' (as the supervisor does) and an engine-side loop."""
from __future__ import annotations

import itertools
import multiprocessing as mp
import sys
import time
from collections.abc import Iterable

import numpy as np

from fastkv.cache.plan import CopyKind, Task, task_of
from fastkv.config import KVLayout
from fastkv.ipc import DoneMsg, Namespace, PeerDied
from fastkv.run import RunSpec, attach_engine, create_run
from fastkv.transfer.client import CopyResult, TransferClient
from fastkv.transfer.tiers import DeviceTier, HostTier
from tests.ipc.helpers import run_objects

CTX = mp.get_context("spawn")
SMALL = KVLayout(num_layers=2, kv_heads=2, block_size=16, head_dim=32, dtype="bfloat16", tp_size=2)
_ids = itertools.count(1)


def transfer_main(spec_json: str, rank: int, per_block_s: float = 0.0) -> None:
    """A transfer process; ``per_block_s`` > 0: its storage backend is a ``SlowStore``."""
    from fastkv.transfer import executor
    from fastkv.transfer.process import main

    if per_block_s:
        opened = executor.open_store
        executor.open_store = lambda *a, **kw: SlowStore(opened(*a, **kw), per_block_s)
    sys.exit(main(spec_json, rank))


class SlowStore:
    """A live but slow storage backend: every block put or got takes ``per_block_s`` more
    (sleeping, as a network round trip waits); ``before_get(block_ids)`` runs first."""

    def __init__(self, store, per_block_s: float, before_get=None) -> None:
        self.store, self.per_block_s, self.before_get = store, per_block_s, before_get

    def put(self, keys, host, block_ids):
        time.sleep(self.per_block_s * len(keys))
        return self.store.put(keys, host, block_ids)

    def get(self, keys, host, block_ids):
        if self.before_get is not None:
            self.before_get(block_ids)
        time.sleep(self.per_block_s * len(keys))
        return self.store.get(keys, host, block_ids)

    @property
    def stats(self):
        return self.store.stats

    def close(self) -> None:
        self.store.close()


def plan(kind: CopyKind, src: Iterable[int] = (), dst: Iterable[int] = (), keys: Iterable[bytes] = ()) -> Task:
    """A copy plan, or a control task given as its wire fields (``task_of``)."""
    return task_of(next(_ids), kind, np.asarray(list(src), np.int32), np.asarray(list(dst), np.int32), tuple(keys))


def key(i: int, salt: str = "") -> bytes:
    return (f"{salt}block{i}".encode() * 32)[:32]


class Supervisor:
    """Creates what the supervisor creates; ``start(r)`` (re)starts transfer[r]."""

    def __init__(self, layout: KVLayout = SMALL, num_device_blocks: int = 16, num_host_blocks: int = 16,
                 **spec_kw) -> None:
        self.ns = Namespace.create()
        self.devices: list[DeviceTier] = []
        self.hosts: list[HostTier] = []
        self.procs: dict[int, mp.Process] = {}
        self.ends = None
        try:
            # a SWAP_IN acked is one landed, as these tests read the device right after the ack;
            # layer-wise loading (acked before the copy) is tests/transfer/test_layerwise.py's
            spec_kw.setdefault("layerwise_load", False)
            self.spec = RunSpec(run_id=self.ns.run_id, layout=layout, num_device_blocks=num_device_blocks,
                                num_host_blocks=num_host_blocks, heartbeat_s=0.2, dead_after_s=2.0, **spec_kw)
            create_run(self.ns, self.spec)
            for r in range(layout.tp_size):
                self.ns.record("shm", f"kvdev{r}")
                self.devices.append(DeviceTier.create(self.spec.tier_prefix, r, layout, num_device_blocks,
                                                      backend="shm"))
                if num_host_blocks:
                    self.ns.record("shm", f"kvhost{r}")
                    self.hosts.append(HostTier.create(self.spec.tier_prefix, r, layout, num_host_blocks))
        except BaseException:
            self.close()
            raise

    @property
    def signals(self):
        return self.ends.signals

    def engine(self, **kw) -> TransferClient:
        self.ends = attach_engine(self.ns, self.spec)
        return TransferClient(self.ends, self.spec, **kw)

    def start(self, rank: int, per_block_s: float = 0.0) -> mp.Process:
        if rank in self.procs:  # a restart: the old one must be gone
            old = self.procs[rank]
            old.join(10)
            assert not old.is_alive(), f"transfer[{rank}] pid {old.pid} still alive"
            self.signals[f"transfer{rank}.gen"] += 1
        p = CTX.Process(target=transfer_main, args=(self.spec.to_json(), rank, per_block_s), daemon=True)
        p.start()
        self.procs[rank] = p
        return p

    def close(self) -> dict[int, int | None]:
        """Stops the processes (signal ``stop``) and removes everything; returns exit codes."""
        codes: dict[int, int | None] = {}
        if self.ends is not None:
            self.signals["stop"] = 1
        for r, p in self.procs.items():
            p.join(15)
            if p.is_alive():
                p.kill()
                p.join()
            codes[r] = p.exitcode
        if self.ends is not None:
            self.ends.close()
        for tier in (*self.devices, *self.hosts):
            tier.unlink()
            tier.close()
        self.ns.close()
        left = run_objects(self.ns.run_id)
        assert not left, f"run {self.ns.run_id} left {left} in /dev/shm"
        return codes


def wait_ready(client: TransferClient, timeout: float = 90.0) -> None:
    """Start-up wait of a test (the engine does the same before its first submit)."""
    deadline = time.monotonic() + timeout
    while not client.ready():
        assert time.monotonic() < deadline, f"transfer processes not ready within {timeout} s"
        time.sleep(0.05)


def pump(sup: Supervisor, client: TransferClient, ids: Iterable[int], timeout: float = 30.0,
         on_result=None) -> dict[int, CopyResult]:
    """The engine's wait loop, until every task in ``ids`` has a result."""
    want, got = set(ids), {}
    deadline = time.monotonic() + timeout
    while not want <= got.keys():
        assert time.monotonic() < deadline, f"tasks {sorted(want - got.keys())} unfinished after {timeout} s"
        try:
            msgs = sup.ends.inbox.recv_many(256, timeout=0.1)
        except PeerDied as exc:
            results = client.on_peer_died(exc)
        else:
            results = [r for m in msgs if isinstance(m, DoneMsg) for r in client.on_done(m)]
        results += client.check()
        for res in results:
            assert res.plan.plan_id not in got, f"task {res.plan.plan_id} completed twice"
            got[res.plan.plan_id] = res
            if on_result is not None:
                on_result(res)
    return got


def run_tasks(sup: Supervisor, client: TransferClient, *plans: Task, timeout: float = 30.0) -> list[CopyResult]:
    for p in plans:
        client.submit(p)
    got = pump(sup, client, [p.plan_id for p in plans], timeout)
    return [got[p.plan_id] for p in plans]


def fill_random(tier: DeviceTier | HostTier, rng: np.random.Generator) -> None:
    arrays = [tier.array] if isinstance(tier, HostTier) else [*tier.k_arrays, *tier.v_arrays]
    for a in arrays:
        a.view(np.uint8)[...] = rng.integers(0, 256, a.nbytes, dtype=np.uint8).reshape(a.view(np.uint8).shape)
    if isinstance(tier, HostTier):  # as if every block had landed by a copy: host checksums match
        tier.seal(range(tier.num_blocks))


def device_blocks(tier: DeviceTier, ids: Iterable[int]) -> list[np.ndarray]:
    """Copies of the given device blocks, every layer, K and V."""
    ids = list(ids)
    return [a[ids].copy() for a in (*tier.k_arrays, *tier.v_arrays)]


def set_device_blocks(tier: DeviceTier, ids: Iterable[int], value: int) -> None:
    ids = list(ids)
    for a in (*tier.k_arrays, *tier.v_arrays):
        a.view(np.uint8).reshape(a.shape[0], -1)[ids] = value

#!/usr/bin/env python
"""IPC benchmark: FastDeploy's EngineCacheQueue pattern vs. a BaseManager queue.Queue vs.
multiprocessing.Queue vs. a fastkv channel, for a ~200-byte copy-task message.

    python scripts/bench_ipc.py [--quick]

Backends (each with one message type: 8 node ids, 8 device block ids, 8 host block ids,
an event type and a task id):
  fastdeploy  BaseManager (TCP) serving a list guarded by a lock; the consumer polls,
              sleeping 1 ms while empty (FastDeploy's EngineCacheQueue)
  bm_queue    BaseManager serving a queue.Queue, blocking get
  mp_queue    multiprocessing.Queue
  fastkv      fastkv.ipc.Channel carrying a TaskMsg (node ids as 8-byte keys)

Measures: round trip (send, echo process answers, receive) p50/p99; one-way messages/s
(fastkv sends and drains in batches, the others per message, their natural API); a
receiver thread fed 2k msgs/s while a pure-Python compute thread in the same process is
100% busy: fraction delivered, p99 delay, and the compute thread's slowdown; CPU of an
idle blocked receiver over 5 s (for the BaseManager backends including the manager
server process that answers it). The last output line is one JSON object.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import queue
import statistics
import sys
import threading
import time
from multiprocessing.managers import AcquirerProxy, BaseManager, ListProxy

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastkv.ipc import Channel, Namespace, TaskMsg  # noqa: E402

CTX = mp.get_context("fork")
BACKENDS = ("fastdeploy", "bm_queue", "mp_queue", "fastkv")
NODE_IDS = list(range(1000, 1008))
DEV_IDS = list(range(8))
HOST_IDS = list(range(100, 108))


def py_msg(stamp: int) -> tuple:
    return (NODE_IDS, DEV_IDS, HOST_IDS, 1, f"task-{stamp}")


def py_stamp(msg: tuple) -> int:
    return int(msg[4][5:])


_DEV, _HOST = np.array(DEV_IDS, np.int32), np.array(HOST_IDS, np.int32)
_KEYS = tuple(i.to_bytes(8, "little") for i in NODE_IDS)


def kv_msg(stamp: int) -> TaskMsg:
    return TaskMsg(stamp, 1, _DEV, _HOST, _KEYS)


# ---- endpoints: one direction of one backend; usable from forked children ------------

_LISTS: dict[str, list] = {}
_LOCKS: dict[str, threading.Lock] = {}
_QUEUES: dict[str, queue.Queue] = {}


class FDManager(BaseManager):
    pass


for _name in ("a", "b"):
    _LISTS[_name], _LOCKS[_name], _QUEUES[_name] = [], threading.Lock(), queue.Queue()
    FDManager.register(f"list_{_name}", callable=lambda n=_name: _LISTS[n], proxytype=ListProxy)
    FDManager.register(f"lock_{_name}", callable=lambda n=_name: _LOCKS[n], proxytype=AcquirerProxy)
    FDManager.register(f"queue_{_name}", callable=lambda n=_name: _QUEUES[n])


class FastDeployEP:
    """EngineCacheQueue: lock + list append; the reader polls len() and sleeps 1 ms."""

    def __init__(self, manager: FDManager, name: str) -> None:
        self.lst, self.lock = getattr(manager, f"list_{name}")(), getattr(manager, f"lock_{name}")()

    def send(self, msg) -> None:
        self.lock.acquire()
        self.lst.append(msg)
        self.lock.release()

    def send_many(self, msgs) -> None:
        for m in msgs:
            self.send(m)

    def recv_many(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if len(self.lst) > 0:
                self.lock.acquire()
                item = self.lst.pop(0)
                self.lock.release()
                return [item]
            if deadline is not None and time.monotonic() >= deadline:
                return []
            time.sleep(0.001)


class BMQueueEP:
    def __init__(self, manager: FDManager, name: str) -> None:
        self.q = getattr(manager, f"queue_{name}")()

    def send(self, msg) -> None:
        self.q.put(msg)

    def send_many(self, msgs) -> None:
        for m in msgs:
            self.q.put(m)

    def recv_many(self, timeout: float | None) -> list:
        try:
            return [self.q.get(timeout=timeout)]
        except queue.Empty:
            return []


class MPQueueEP:
    def __init__(self, q) -> None:
        self.q = q

    def send(self, msg) -> None:
        self.q.put(msg)

    def send_many(self, msgs) -> None:
        for m in msgs:
            self.q.put(m)

    def recv_many(self, timeout: float | None) -> list:
        try:
            return [self.q.get(timeout=timeout)]
        except queue.Empty:
            return []


class FastKVEP:
    """Attaches to the channel lazily in whichever process uses it."""

    def __init__(self, run_id: str, name: str) -> None:
        self.run_id, self.name, self.pid, self.ch = run_id, name, None, None

    def _ch(self) -> Channel:
        if self.pid != os.getpid():
            self.ch = Channel.attach(Namespace.attach(self.run_id), self.name)
            self.pid = os.getpid()
        return self.ch

    def send(self, msg) -> None:
        self._ch().send(msg)

    def send_many(self, msgs) -> None:
        self._ch().send_many(msgs)

    def recv_many(self, timeout: float | None) -> list:
        return self._ch().recv_many(256, timeout)


class Backend:
    """Two directions (a: main -> child, b: child -> main) of one backend."""

    def __init__(self, name: str) -> None:
        self.name, self.server_pid = name, None
        self.make = kv_msg if name == "fastkv" else py_msg
        self.stamp = (lambda m: m.task_id) if name == "fastkv" else py_stamp
        if name in ("fastdeploy", "bm_queue"):
            self.manager = FDManager(address=("127.0.0.1", 0), authkey=b"bench", ctx=CTX)
            self.manager.start()
            self.server_pid = self.manager._process.pid
            cls = FastDeployEP if name == "fastdeploy" else BMQueueEP
            self.a, self.b = cls(self.manager, "a"), cls(self.manager, "b")
        elif name == "mp_queue":
            self.a, self.b = MPQueueEP(CTX.Queue()), MPQueueEP(CTX.Queue())
        else:
            self.ns = Namespace.create()
            self.chans = [Channel.create(self.ns, n, slot_size=256, nslots=4096) for n in ("a", "b")]
            self.a, self.b = FastKVEP(self.ns.run_id, "a"), FastKVEP(self.ns.run_id, "b")

    def close(self) -> None:
        if self.name in ("fastdeploy", "bm_queue"):
            self.manager.shutdown()
        elif self.name == "fastkv":
            for ch in self.chans:
                ch.close()
            self.ns.close()


# ---- measurements -------------------------------------------------------------------

def _echo(be: Backend, n: int) -> None:
    for _ in range(n):
        msgs = be.a.recv_many(30)
        be.b.send_many(msgs)


def round_trip(be: Backend, n: int) -> tuple[float, float]:
    child = CTX.Process(target=_echo, args=(be, n + 20))
    child.start()
    rtts = []
    for i in range(n + 20):
        t0 = time.perf_counter()
        be.a.send(be.make(i))
        got = be.b.recv_many(30)
        rtts.append(time.perf_counter() - t0)
        assert got and be.stamp(got[0]) == i, f"{be.name}: echo mismatch"
    child.join(30)
    rtts = sorted(rtts[20:])
    return rtts[len(rtts) // 2] * 1e6, rtts[int(len(rtts) * 0.99)] * 1e6


def _flood(be: Backend, n: int, batch: int) -> None:
    msg = be.make(0)
    for i in range(0, n, batch):
        be.a.send_many([msg] * min(batch, n - i))  # every message encoded/pickled on its own


def one_way(be: Backend, n: int) -> float:
    child = CTX.Process(target=_flood, args=(be, n, 64))
    child.start()
    got = len(be.a.recv_many(30))
    t0 = time.perf_counter()
    while got < n:
        got += len(be.a.recv_many(30))
    dt = time.perf_counter() - t0
    child.join(30)
    return (n - 1) / dt


def _feed(be: Backend, rate: float, seconds: float, conn) -> None:
    n = int(rate * seconds)
    start = time.monotonic() + 0.05
    for i in range(n):
        delay = start + i / rate - time.monotonic()
        if delay > 0:
            time.sleep(delay)  # pacing the load generator, outside fastkv
        be.b.send(be.make(time.monotonic_ns()))
    conn.send(n)


def _compute(stop: threading.Event, out: list) -> None:
    n = 0
    while not stop.is_set():
        x = 0
        for i in range(200):
            x += i * i
        n += 1
    out.append(n)


def compute_rate(seconds: float) -> float:
    stop, out = threading.Event(), []
    t = threading.Thread(target=_compute, args=(stop, out))
    t0 = time.perf_counter()
    t.start()
    time.sleep(seconds)
    stop.set()
    t.join()
    return out[0] / (time.perf_counter() - t0)


def busy_receiver(be: Backend, seconds: float, rate: float = 2000.0) -> tuple[float, float, float]:
    """Returns (fraction delivered, p99 delay ms, compute iterations/s)."""
    delays: list[float] = []
    stop_rx, stop_cpu, out = threading.Event(), threading.Event(), []

    def rx() -> None:
        while not stop_rx.is_set():
            for m in be.b.recv_many(0.05):
                delays.append(time.monotonic_ns() - be.stamp(m))

    parent, conn = CTX.Pipe()
    receiver = threading.Thread(target=rx)
    receiver.start()
    cpu = threading.Thread(target=_compute, args=(stop_cpu, out))
    feeder = CTX.Process(target=_feed, args=(be, rate, seconds, conn))
    t0 = time.perf_counter()
    cpu.start()
    feeder.start()
    sent = parent.recv()
    time.sleep(0.1)  # grace for the last messages
    delivered = len(delays)
    stop_cpu.set()
    cpu.join()
    elapsed = time.perf_counter() - t0
    stop_rx.set()
    receiver.join(30)
    feeder.join(30)
    be_drain(be)
    p99 = float(np.percentile(delays, 99)) / 1e6 if delays else float("inf")
    return min(1.0, delivered / sent), p99, out[0] / elapsed


def be_drain(be: Backend) -> None:
    while be.b.recv_many(0.05):
        pass


def _idle(be: Backend, conn) -> None:
    conn.send("ready")
    be.a.recv_many(60)  # nothing ever comes: blocked (or polling) until killed


def _cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def idle_cpu(backends: dict[str, Backend], seconds: float) -> dict[str, float]:
    kids = {}
    for name, be in backends.items():
        parent, conn = CTX.Pipe()
        p = CTX.Process(target=_idle, args=(be, conn))
        p.start()
        assert parent.recv() == "ready"
        kids[name] = p
    time.sleep(0.3)  # let start-up settle
    pids = {n: [p.pid] + ([backends[n].server_pid] if backends[n].server_pid else []) for n, p in kids.items()}
    before = {n: sum(_cpu_seconds(p) for p in ps) for n, ps in pids.items()}
    time.sleep(seconds)
    after = {n: sum(_cpu_seconds(p) for p in ps) for n, ps in pids.items()}
    for p in kids.values():
        p.kill()
        p.join()
    return {n: (after[n] - before[n]) / seconds for n in kids}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer iterations; finishes in under a minute")
    args = ap.parse_args()
    q = args.quick
    rtt_n = {"fastdeploy": 150 if q else 1000, "bm_queue": 500 if q else 3000}
    flow_n = {"fastdeploy": 600 if q else 3000, "bm_queue": 2000 if q else 10000, "mp_queue": 20000 if q else 100000,
              "fastkv": 200000 if q else 1000000}
    busy_s = 2.0 if q else 5.0
    res: dict[str, dict[str, float]] = {k: {} for k in ("rtt_p50_us", "rtt_p99_us", "msgs_per_s", "busy_delivered",
                                                         "busy_p99_ms", "busy_slowdown", "idle_cpu")}
    # fresh backends for the idle test: a killed BaseManager client leaves its blocked get
    # pending in the server, which would swallow a later message
    idle_backends = {name: Backend(name) for name in BACKENDS}
    try:
        res["idle_cpu"].update(idle_cpu(idle_backends, 5.0))
    finally:
        for be in idle_backends.values():
            be.close()
    backends = {name: Backend(name) for name in BACKENDS}
    try:
        alone = [compute_rate(busy_s)]
        for name, be in backends.items():
            p50, p99 = round_trip(be, rtt_n.get(name, 3000 if q else 20000))
            res["rtt_p50_us"][name], res["rtt_p99_us"][name] = p50, p99
            res["msgs_per_s"][name] = one_way(be, flow_n[name])
            delivered, p99_ms, rate = busy_receiver(be, busy_s)
            res["busy_delivered"][name], res["busy_p99_ms"][name] = delivered, p99_ms
            res["busy_slowdown"][name] = rate
            print(f"  {name}: done", file=sys.stderr, flush=True)
        alone.append(compute_rate(busy_s))
    finally:
        for be in backends.values():
            be.close()
    base = statistics.mean(alone)
    for name in BACKENDS:
        res["busy_slowdown"][name] = max(0.0, 1.0 - res["busy_slowdown"][name] / base)

    print(f"IPC benchmark ({'quick' if q else 'full'}; {os.cpu_count()} cores; ~200-byte task message; "
          f"compute thread alone {base:,.0f} it/s, runs {alone[0]:,.0f} / {alone[1]:,.0f})")
    cols = [("rtt_p50_us", "RTT p50 us", "{:.1f}"), ("rtt_p99_us", "RTT p99 us", "{:.1f}"),
            ("msgs_per_s", "one-way msg/s", "{:,.0f}"), ("busy_delivered", "busy deliv.", "{:.1%}"),
            ("busy_p99_ms", "busy p99 ms", "{:.2f}"), ("busy_slowdown", "cpu slowdown", "{:.1%}"),
            ("idle_cpu", "idle cpu", "{:.2%}")]
    print(f"{'backend':<12}" + "".join(f"{title:>15}" for _, title, _ in cols))
    for name in BACKENDS:
        print(f"{name:<12}" + "".join(f"{fmt.format(res[k][name]):>15}" for k, _, fmt in cols))
    fk = res["rtt_p50_us"]["fastkv"]
    print(f"fastkv RTT p50 = 1/{res['rtt_p50_us']['fastdeploy'] / fk:.0f} of fastdeploy, "
          f"1/{res['rtt_p50_us']['mp_queue'] / fk:.1f} of mp_queue")
    out = {"bench": "ipc"}
    out.update({k: {n: round(v, 6) for n, v in d.items()} for k, d in res.items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()

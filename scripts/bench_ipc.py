#!/usr/bin/env python
"""IPC benchmark: FastDeploy's EngineCacheQueue pattern vs. a BaseManager queue.Queue vs.
multiprocessing.Queue vs. a fastkv channel, for a ~200-byte copy-task message.

    python scripts/bench_ipc.py [--quick | --smoke]

Backends (each with one message type: 8 node ids, 8 device block ids, 8 host block ids,
an event type and a task id):
  fastdeploy  BaseManager (TCP) serving a list guarded by a lock; the consumer polls,
              sleeping 1 ms while empty (a simplified EngineCacheQueue, kept for comparison
              with earlier runs)
  fastdeploy_faithful
              FastDeploy's protocol as its cache manager runs it: tasks (main -> child) go
              through put_transfer_task (lock, task_sync_value.set(0), append) and are taken
              by a CacheTransferManager loop spinning on empty() RPCs without sleeping, then
              get_transfer_task (lock, sync-value read/or/write, read the head, pop once every
              rank read it); done signals (child -> main) go through put_transfer_done_signal
              and get_transfer_done_signal, polled with a 1 ms sleep as the engine's receive
              thread does. Every message is logged at each end to a per-process log file.
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
import gc
import json
import logging
import multiprocessing as mp
import os
import queue
import shutil
import sys
import tempfile
import threading
import time
from multiprocessing.managers import AcquirerProxy, BaseManager, ListProxy, Value, ValueProxy

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fastkv.ipc import Channel, Namespace, TaskMsg, encode  # noqa: E402

CTX = mp.get_context("fork")
BACKENDS = ("fastdeploy", "fastdeploy_faithful", "bm_queue", "mp_queue", "fastkv")
FD_BACKENDS = ("fastdeploy", "fastdeploy_faithful")  # served by a BaseManager
SPINNING = ("fastdeploy_faithful",)  # an idle receiver busy-polls: measured apart from the others
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
_SYNC: dict[str, Value] = {}


class FDManager(BaseManager):
    pass


for _name in ("a", "b"):
    _LISTS[_name], _LOCKS[_name], _QUEUES[_name], _SYNC[_name] = [], threading.Lock(), queue.Queue(), Value("i", 0)
    FDManager.register(f"list_{_name}", callable=lambda n=_name: _LISTS[n], proxytype=ListProxy)
    FDManager.register(f"lock_{_name}", callable=lambda n=_name: _LOCKS[n], proxytype=AcquirerProxy)
    FDManager.register(f"queue_{_name}", callable=lambda n=_name: _QUEUES[n])
    FDManager.register(f"sync_{_name}", callable=lambda n=_name: _SYNC[n], proxytype=ValueProxy)


class FastDeployEP:
    """Simplified EngineCacheQueue: lock + list append; the reader polls len() and sleeps 1 ms."""

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


_FD_LOG: dict[int, logging.Logger] = {}


def fd_log(log_dir: str) -> logging.Logger:
    """This process's FastDeploy-style logger: INFO lines to its own file, as each FastDeploy
    component writes its log file (the handler's lock, formatting and write on every message)."""
    log = _FD_LOG.get(os.getpid())
    if log is None:
        log = logging.getLogger(f"bench_ipc.fastdeploy.{os.getpid()}")
        log.setLevel(logging.INFO)
        log.propagate = False
        handler = logging.FileHandler(os.path.join(log_dir, f"cache_manager.{os.getpid()}.log"))
        handler.setFormatter(logging.Formatter("[%(asctime)s] [%(levelname)8s] %(filename)s:%(lineno)d - %(message)s"))
        log.addHandler(handler)
        _FD_LOG[os.getpid()] = log
    return log


class FaithfulTaskEP(FastDeployEP):
    """EngineCacheQueue's transfer-task direction, one TP rank (client bit 1 of a total of 1).
    The receiver is CacheTransferManager.do_data_transfer: ``empty()`` RPCs in a loop, no sleep."""

    POSITION, TOTAL = 1, 1

    def __init__(self, manager: FDManager, name: str, log_dir: str) -> None:
        super().__init__(manager, name)
        self.sync, self.log_dir = getattr(manager, f"sync_{name}")(), log_dir

    def send(self, msg) -> None:  # put_transfer_task
        self.lock.acquire()
        self.sync.set(0)
        self.lst.append(msg)
        self.lock.release()
        fd_log(self.log_dir).info(f"put_transfer_task: put swap task {msg[-1]} to queue successful")

    def empty(self) -> bool:
        return len(self.lst) == 0

    def get_transfer_task(self) -> tuple[object, bool]:
        data, read_finish = None, False
        self.lock.acquire()
        if self.sync.get() & self.POSITION == 0 and len(self.lst) > 0:
            data = self.lst[0]
            value = self.sync.get() | self.POSITION
            self.sync.set(value)
            if value == self.TOTAL:  # every rank read it
                self.lst.pop(0)
                self.sync.set(0)
                read_finish = True
        self.lock.release()
        return data, read_finish

    def recv_many(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.empty():
            if deadline is not None and time.monotonic() >= deadline:
                return []
        data, _ = self.get_transfer_task()
        fd_log(self.log_dir).info(f"transfer data: get_transfer_task {data}")
        return [] if data is None else [data]


class FaithfulDoneEP(FastDeployEP):
    """EngineCacheQueue's done-signal direction; the receiver is the cache manager's
    recv_data_transfer_result thread: get_transfer_done_signal, 1 ms sleep when there is none."""

    def __init__(self, manager: FDManager, name: str, log_dir: str) -> None:
        super().__init__(manager, name)
        self.log_dir = log_dir

    def send(self, msg) -> None:  # put_transfer_done_signal
        super().send(msg)
        fd_log(self.log_dir).info(f"put_transfer_done_signal: task {msg[-1]} done")

    def recv_many(self, timeout: float | None) -> list:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            self.lock.acquire()  # get_transfer_done_signal
            item = self.lst.pop(0) if len(self.lst) > 0 else None
            self.lock.release()
            if item is not None:
                fd_log(self.log_dir).info(f"recv_data_transfer_result: {item}")
                return [item]
            if deadline is not None and time.monotonic() >= deadline:
                return []
            time.sleep(0.001)


class QueueEP:
    """A queue endpoint: put per message, blocking get (multiprocessing.Queue or a BaseManager proxy)."""

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


class BMQueueEP(QueueEP):
    def __init__(self, manager: FDManager, name: str) -> None:
        super().__init__(getattr(manager, f"queue_{name}")())


MPQueueEP = QueueEP


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
        if name in (*FD_BACKENDS, "bm_queue"):
            self.manager = FDManager(address=("127.0.0.1", 0), authkey=b"bench", ctx=CTX)
            self.manager.start()
            self.server_pid = self.manager._process.pid
            if name == "fastdeploy_faithful":
                self.log_dir = tempfile.mkdtemp(prefix="fkv-bench-fdlog-")
                self.a = FaithfulTaskEP(self.manager, "a", self.log_dir)
                self.b = FaithfulDoneEP(self.manager, "b", self.log_dir)
            else:
                cls = FastDeployEP if name == "fastdeploy" else BMQueueEP
                self.a, self.b = cls(self.manager, "a"), cls(self.manager, "b")
        elif name == "mp_queue":
            self.a, self.b = MPQueueEP(CTX.Queue()), MPQueueEP(CTX.Queue())
        else:
            self.ns = Namespace.create()
            self.chans = [Channel.create(self.ns, n, slot_size=256, nslots=16384) for n in ("a", "b")]
            self.a, self.b = FastKVEP(self.ns.run_id, "a"), FastKVEP(self.ns.run_id, "b")

    def close(self) -> None:
        if self.name in (*FD_BACKENDS, "bm_queue"):
            self.manager.shutdown()
        if self.name == "fastdeploy_faithful":
            shutil.rmtree(self.log_dir, ignore_errors=True)
        elif self.name == "fastkv":
            for ch in self.chans:
                ch.close()
            self.ns.close()


# ---- measurements -------------------------------------------------------------------

def _echo(be: Backend, turn) -> None:
    """Echo messages back; a negative stamp ends a turn (-1) or the process (-2). Between
    turns the process blocks on ``turn``, so a polling backend loads no one else's turn."""
    held: list = []  # what came after a turn's end in the same batch: the next turn's first messages
    while True:
        turn.acquire()
        while True:
            msgs, held = held or be.a.recv_many(60), []
            if not msgs:
                raise RuntimeError(f"{be.name}: echo got nothing for 60 s")
            stamps = [be.stamp(m) for m in msgs]
            end = next((i for i, s in enumerate(stamps) if s < 0), len(msgs))
            if end:
                be.b.send_many(msgs[:end])
            if end < len(msgs):
                held = msgs[end + 1:]
                break
        if stamps[end] == -2:
            return


def round_trips(backends: dict[str, Backend], counts: dict[str, int], rounds: int) -> dict[str, tuple[float, float]]:
    """Round trips (send; an echo process sends it back; receive). The backends take turns
    over several rounds, so each sees the same (shared) machine."""
    turns = {name: CTX.Semaphore(0) for name in backends}
    kids = {name: CTX.Process(target=_echo, args=(be, turns[name])) for name, be in backends.items()}
    for kid in kids.values():
        kid.start()
    rtts: dict[str, list[float]] = {name: [] for name in backends}
    for rnd in range(rounds):
        for name, be in backends.items():
            turns[name].release()
            for i in range(counts[name] + 3):
                t0 = time.perf_counter()
                be.a.send(be.make(i))
                got = be.b.recv_many(30)
                if i >= 3:  # the first ones of a turn wake the echo process up
                    rtts[name].append(time.perf_counter() - t0)
                assert got and be.stamp(got[0]) == i, f"{name}: echo mismatch"
            be.a.send(be.make(-2 if rnd == rounds - 1 else -1))
    for kid in kids.values():
        kid.join(30)
    out = {}
    for name, r in rtts.items():
        r.sort()
        out[name] = (r[len(r) // 2] * 1e6, r[int(len(r) * 0.99)] * 1e6)
    return out


def _flood(be: Backend, n: int, raw: bool, ready, go) -> None:
    msg = be.make(0)
    if raw:
        buf, ch = encode(msg), be.a._ch()
    ready.release()
    go.acquire()
    for i in range(0, n, 64):
        if raw:
            ch.send_encoded([buf] * min(64, n - i))
        else:
            be.a.send_many([msg] * min(64, n - i))  # every message encoded/pickled on its own


def one_way(be: Backend, n: int, raw: bool = False) -> float:
    """Messages/s from a flooding process to this one. ``raw``: the fastkv ring alone
    (pre-encoded messages, no decode), for reference."""
    ready, go = CTX.Semaphore(0), CTX.Semaphore(0)
    child = CTX.Process(target=_flood, args=(be, n, raw, ready, go))
    child.start()
    ready.acquire()  # the child is set up (forked, attached): time the messages only
    recv = be.a._ch().ring.pop_many if raw else (lambda: be.a.recv_many(30))
    t0 = time.perf_counter()
    go.release()
    got = 0
    while got < n:
        got += len(recv(256, 30) if raw else recv())
    dt = time.perf_counter() - t0
    child.join(30)
    return n / dt


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


def busy_window(be: Backend, seconds: float, receive: bool, rate: float = 2000.0) -> tuple[int, list, float]:
    """A feeder process sends ``rate`` msgs/s for ``seconds`` while a pure-Python compute
    thread runs; with ``receive`` a receiver thread in the same process takes them.
    Returns (messages sent, delays in ns of those delivered in time, compute iterations/s)."""
    delays: list[float] = []
    stop_rx, stop_cpu, out = threading.Event(), threading.Event(), []

    def rx() -> None:
        while not stop_rx.is_set():
            for m in be.b.recv_many(0.05):
                delays.append(time.monotonic_ns() - be.stamp(m))

    parent, conn = CTX.Pipe()
    receiver = threading.Thread(target=rx)
    if receive:
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
    if receive:
        receiver.join(30)
    while feeder.is_alive():  # an mp.Queue feeder cannot exit before its pipe is read
        be_drain(be)
        feeder.join(0.1)
    be_drain(be)
    return sent, delays[:delivered], out[0] / elapsed


def busy_receiver(be: Backend, seconds: float, pairs: int) -> tuple[float, float, float]:
    """(delivered, p99 ms, compute slowdown). The slowdown compares the compute thread with
    and without the receiver thread, the feeder running both times, in alternating windows
    (medians), so that the load of the feeder and of the rest of a shared machine cancels."""
    base, busy, sent, delays = [], [], 0, []
    for _ in range(pairs):
        base.append(busy_window(be, seconds, receive=False)[2])
        n, d, r = busy_window(be, seconds, receive=True)
        sent, delays, busy = sent + n, delays + d, busy + [r]
    p99 = float(np.percentile(delays, 99)) / 1e6 if delays else float("inf")
    return min(1.0, len(delays) / sent), p99, max(0.0, 1.0 - float(np.median(busy)) / float(np.median(base)))


def be_drain(be: Backend) -> None:
    if isinstance(be.b, FastDeployEP):  # one RPC instead of three per message
        be.b.lock.acquire()
        del be.b.lst[:]
        be.b.lock.release()
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
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--quick", action="store_true", help="fewer iterations; finishes in under a minute")
    mode.add_argument("--smoke", action="store_true", help="tiny sizes, a few seconds: checks that the script runs "
                      "(the tests); the numbers mean nothing")
    args = ap.parse_args()
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    pick = lambda smoke, quick, full: {"smoke": smoke, "quick": quick, "full": full}[size]  # noqa: E731
    rtt_n = {"fastdeploy": pick(3, 15, 100), "fastdeploy_faithful": pick(3, 15, 100), "bm_queue": pick(3, 50, 300),
             "mp_queue": pick(5, 200, 2000), "fastkv": pick(5, 200, 2000)}  # per round
    flow_n = {"fastdeploy": pick(50, 600, 3000), "fastdeploy_faithful": pick(50, 600, 3000),
              "bm_queue": pick(50, 2000, 10000), "mp_queue": pick(100, 20000, 100000),
              "fastkv": pick(1000, 200000, 1000000)}
    busy_s, pairs = pick((0.2, 1), (1.0, 2), (3.0, 3))
    rounds, idle_s = pick(2, 10, 10), pick(0.3, 5.0, 5.0)
    res: dict[str, dict[str, float]] = {k: {} for k in ("rtt_p50_us", "rtt_p99_us", "msgs_per_s", "busy_delivered",
                                                         "busy_p99_ms", "busy_slowdown", "idle_cpu")}
    t_start = time.perf_counter()
    # A spinning idle receiver (and its manager server) takes cores from the others' idle
    # receivers and servers: measured in its own window.
    for group in ([n for n in BACKENDS if n not in SPINNING], SPINNING):
        # fresh backends for the idle test: a killed BaseManager client leaves its blocked get
        # pending in the server, which would swallow a later message
        idle_backends = {name: Backend(name) for name in group}
        try:
            res["idle_cpu"].update(idle_cpu(idle_backends, idle_s))
        finally:
            for be in idle_backends.values():
                be.close()
            del idle_backends, be  # forked children would re-register their manager proxies
            gc.collect()
    backends = {name: Backend(name) for name in BACKENDS}
    try:
        for name, (p50, p99) in round_trips(backends, rtt_n, rounds).items():
            res["rtt_p50_us"][name], res["rtt_p99_us"][name] = p50, p99
        print(f"  round trips done at {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
        for name, be in backends.items():
            res["msgs_per_s"][name] = one_way(be, flow_n[name])
            res["busy_delivered"][name], res["busy_p99_ms"][name], res["busy_slowdown"][name] = \
                busy_receiver(be, busy_s, pairs)
            print(f"  {name}: done at {time.perf_counter() - t_start:.1f} s", file=sys.stderr, flush=True)
        raw_rate = one_way(backends["fastkv"], 10 * flow_n["fastkv"], raw=True)
    finally:
        for be in backends.values():
            be.close()
    print(f"IPC benchmark ({size}; {os.cpu_count()} cores; ~200-byte task message; "
          f"load average {os.getloadavg()[0]:.1f})")
    cols = [("rtt_p50_us", "RTT p50 us", "{:.1f}"), ("rtt_p99_us", "RTT p99 us", "{:.1f}"),
            ("msgs_per_s", "one-way msg/s", "{:,.0f}"), ("busy_delivered", "busy deliv.", "{:.1%}"),
            ("busy_p99_ms", "busy p99 ms", "{:.2f}"), ("busy_slowdown", "cpu slowdown", "{:.1%}"),
            ("idle_cpu", "idle cpu", "{:.2%}")]
    print(f"{'backend':<20}" + "".join(f"{title:>15}" for _, title, _ in cols))
    for name in BACKENDS:
        print(f"{name:<20}" + "".join(f"{fmt.format(res[k][name]):>15}" for k, _, fmt in cols))
    fk = res["rtt_p50_us"]["fastkv"]
    print(f"fastkv RTT p50 = 1/{res['rtt_p50_us']['fastdeploy'] / fk:.0f} of fastdeploy (simplified), "
          f"1/{res['rtt_p50_us']['fastdeploy_faithful'] / fk:.0f} of fastdeploy_faithful, "
          f"1/{res['rtt_p50_us']['mp_queue'] / fk:.1f} of mp_queue")
    print(f"fastkv ring alone (pre-encoded 208-byte messages, no decode): {raw_rate:,.0f} msg/s")
    out = {"bench": "ipc"}
    out.update({k: {n: round(v, 6) for n, v in d.items()} for k, d in res.items()})
    print(json.dumps(out))


if __name__ == "__main__":
    main()

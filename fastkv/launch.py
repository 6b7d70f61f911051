"""One call that sets up a run, for a deployment that embeds fastkv and for the supervisor::

    from fastkv.launch import launch

    with launch(spec) as run:              # namespace, channels, tiers, one transfer process per rank
        run.start("worker", 0, "my_pkg.worker:main")   # your workers: main(spec_json, rank) -> int
        engine = Engine.attach(run.spec)
        engine.wait_until_ready()
        ...
    # on leaving the block (normally, by an exception, by SIGINT/SIGTERM): every process
    # started is stopped, every shared object unlinked

``launch`` removes what dead runs left behind (``cleanup_stale``), builds the swap ops when
this machine has never built them, creates the run's namespace and channels
(``fastkv.run.create_run``), records and creates the KV tiers of every rank (allocated at
once: a tier that does not fit fails here, naming the flag that sized it), starts
``fastkv.transfer.process.main`` per rank and waits until each is up. A transfer process
that dies during start-up fails the launch at once (``LaunchError`` naming the rank and the
last line of its log, ``<out_dir>/logs/transfer<r>.log``). While the block runs, a watcher
thread replaces a transfer process that dies (exit, signal or a heartbeat silent for
``spec.dead_after_s``): ``transfer{r}.gen`` is bumped first, so the engine fails the copies
in flight on that rank (their requests recompute) and adopts the new process. After
``max_restarts`` it sets ``stop`` instead: the engine raises ``EngineStopped``, and
``run.failure`` says why.

GPU deployments: the worker allocates (``DeviceTier.create(..., backend="cuda")``) or adopts
(``DeviceTier.adopt``) the device tier of its rank, and the transfer process attaches it by
CUDA IPC, so the transfer processes start after the workers::

    with launch(spec, device_tiers="worker") as run:   # device tiers recorded, not created
        start your workers; each creates or adopts its device tier
        run.start_transfers()                           # then the transfer processes, up or LaunchError

The supervisor (``fastkv.cli.supervisor``) sets up its runs with the same ``Launch`` (no watcher
thread: its own loop watches every process, and it handles the signals).
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

from fastkv.ipc import Namespace, SignalArray, cleanup_stale
from fastkv.ipc.namespace import SHM_DIR
from fastkv.ipc.semwait import clear_stop, raise_stop
from fastkv.procs.children import STOP_SIGNALS, Child, _child_main, describe_exit, last_line
from fastkv.run import READY, STARTING, RunSpec, create_run

TRANSFER = "fastkv.transfer.process:main"  # main(spec_json, rank) -> int
DEVICE_TIERS = ("auto", "launch", "worker")
# How often start-up looks at the ready flags between process deaths (a death wakes it at once).
_READY_SLICE_S = 0.05
# After a stop signal: how long the children get to exit by themselves, then after a SIGTERM
_SIGNAL_GRACE_S = 2.0
_TERM_GRACE_S = 1.0


# multiprocessing's spawn imports the serving script again in every child it starts: a launch()
# at the script's top level would run again there
SPAWN_GUARD = ('put the code that launches under `if __name__ == "__main__":` (every process fastkv starts '
               'imports the script again)')


class LaunchError(RuntimeError):
    """The run could not be set up or started (one line: what, where, why)."""


@contextmanager
def _tier_fits(tier: str, rank: int, num_blocks: int, block_bytes: int) -> Iterator[None]:
    """Says which flag sized a tier that does not fit."""
    try:
        yield
    except MemoryError as exc:
        raise MemoryError(f"the {tier} tier of rank {rank} (--{tier}-blocks {num_blocks} x "
                          f"{block_bytes / 2**10:.0f} KiB) does not fit: {exc}") from None


class Launch:
    """The shared objects and processes of one run (module docstring). ``launch()`` drives it;
    the supervisor calls its steps itself.

    device_tiers: "launch" creates each rank's device tier in shared memory, "worker" leaves it
    to the worker (GPU: CUDA IPC), "auto" is "worker" on a CUDA build, else "launch".
    entry_points: role -> "module:function" of the processes ``start`` spawns by role.
    say: where one-line notices go (stale objects removed, a transfer process restarted).
    mp_context: the multiprocessing context children are spawned with (default "spawn").
    """

    def __init__(self, spec: RunSpec, *, log_dir: str | Path | None = None, manifest_dir: str | Path = SHM_DIR,
                 device_tiers: str = "auto", entry_points: dict[str, str] | None = None, max_restarts: int = 3,
                 startup_timeout_s: float = 180.0, join_timeout_s: float = 15.0,
                 say: Callable[[str], None] | None = None, mp_context: Any = None) -> None:
        if not isinstance(spec, RunSpec):
            raise TypeError(f"spec must be a RunSpec, got {type(spec).__name__}")
        if getattr(mp.current_process(), "_inheriting", False):
            # a spawned child importing the serving script again: a traceback here would say nothing
            raise SystemExit(f"fastkv: the serving script calls launch() when imported; {SPAWN_GUARD}")
        if device_tiers not in DEVICE_TIERS:
            raise ValueError(f"device_tiers must be one of {DEVICE_TIERS}, got {device_tiers!r}")
        if max_restarts < 0 or startup_timeout_s <= 0 or join_timeout_s <= 0:
            raise ValueError("need max_restarts >= 0, startup_timeout_s > 0 and join_timeout_s > 0")
        self.spec = spec
        self.log_dir = Path(log_dir if log_dir is not None else Path(spec.out_dir) / "logs").resolve()
        self.manifest_dir = Path(manifest_dir)
        self.device_tiers = device_tiers
        self.entry_points = {"transfer": TRANSFER, **(entry_points or {})}
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.join_timeout_s = join_timeout_s
        self.say = say or (lambda text: print(f"fastkv: {text}", file=sys.stderr, flush=True))
        self._ctx = mp_context or mp.get_context("spawn")
        self.children: dict[str, Child] = {}
        self.ns: Namespace | None = None
        self.signals: SignalArray | None = None
        self.failure: str | None = None  # why the watcher gave up (then ``stop`` is set)
        self._tiers: list[Any] = []
        self._watcher: threading.Thread | None = None
        self._closing = False
        self._joined = threading.Event()  # shutdown() has stopped every process: the watcher may end
        self._wake_r = self._wake_w = -1

    # -- set-up ------------------------------------------------------------------------
    def setup(self, cuda: bool | None = None) -> None:
        """Stale cleanup, namespace, channels, tiers (MemoryError naming the flag of a tier that
        does not fit). ``cuda``: whether this is a CUDA build (None: ask Paddle)."""
        from fastkv.transfer.tiers import DeviceTier, HostTier, _cuda_available

        if cuda is None:
            cuda = _cuda_available()
        removed = cleanup_stale(self.manifest_dir)
        if removed:
            self.say(f"removed {len(removed)} objects left by dead runs")
        Path(self.spec.out_dir).mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        spec = self.spec
        workers_make_device = self.device_tiers == "worker" or (self.device_tiers == "auto" and cuda)
        self.ns = Namespace.create(spec.run_id, self.manifest_dir)
        create_run(self.ns, spec)
        for r in range(spec.tp_size):
            # Recorded first: a crash between record and create leaves nothing unlisted.
            self.ns.record("shm", f"kvdev{r}")
            # Allocated now (populate), as a GPU deployment's are: a tier too big fails here.
            with _tier_fits("device", r, spec.num_device_blocks, spec.layout.block_bytes):
                if not workers_make_device:
                    self._tiers.append(DeviceTier.create(spec.tier_prefix, r, spec.layout, spec.num_device_blocks,
                                                         layer_blocks=spec.layer_blocks(),
                                                         backend="shm", populate=True))
            for g, layout, n in spec.host_tiers():  # a hybrid's: a segment per KV cache group
                self.ns.record("shm", f"kvhost{r}" + ("" if g is None else f"g{g}"))
                with _tier_fits("host", r, spec.num_host_blocks, spec.layout.block_bytes):
                    self._tiers.append(HostTier.create(spec.tier_prefix, r, layout, n, populate=True, group=g))
        self.signals = SignalArray.attach(self.ns, "signals")

    def start(self, role: str, rank: int, target: str | None = None, args: tuple | None = None) -> Child:
        """Spawns one process of the run, logging to ``<log_dir>/<name>.log`` and dying with this
        one: ``target`` ("module:function", default ``entry_points[role]``) called with ``args``
        (default ``(spec_json, rank)``); its return value is the exit status. Returns its Child."""
        target = target or self.entry_points.get(role)
        if target is None:
            raise ValueError(f"no entry point for role {role!r}; pass target='module:function'")
        name = "engine" if role == "engine" else f"{role}{rank}"
        args = (self.spec.to_json(), rank) if args is None else args
        proc = self._ctx.Process(
            target=_child_main, name=f"fastkv-{name}",
            args=(target, args, os.getpid(), str(self.log_dir / f"{name}.log"), (role, rank, self.spec.run_id)),
        )
        old = self.children.get(name)
        child = Child(name, role, rank, proc, time.monotonic_ns(), old.restarts if old else 0)
        self.children[name] = child
        proc.start()
        if role == "worker" and self.signals is not None and f"{name}.pid" in self.signals.names:
            # the engine watches this pid from now on: a worker that dies before it attaches is seen too
            self.signals[f"{name}.pid"] = proc.pid
        return child

    def start_transfers(self, wait: bool = True) -> None:
        """One transfer process per rank; with ``wait``, until each is up (``wait_ready``)."""
        for rank in range(self.spec.tp_size):
            self.start("transfer", rank)
        if wait:
            self.wait_ready([f"transfer{r}" for r in range(self.spec.tp_size)])

    def wait_ready(self, names: list[str] | None = None, timeout: float | None = None) -> None:
        """Blocks until the processes ``names`` (default: all started) set their ready flag.
        LaunchError at once when one dies first, naming it and its log's last line; or after
        ``timeout`` (default ``startup_timeout_s``)."""
        assert self.signals is not None, "wait_ready before setup"
        timeout = self.startup_timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        waiting = [self.children[n] for n in (names if names is not None else list(self.children))]
        while True:
            for child in waiting:
                if child.process.exitcode is not None:
                    raise LaunchError(self.death(child, "during start-up"))
            waiting = [c for c in waiting if self.signals[f"{c.name}.ready"] != READY]
            if not waiting:
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise LaunchError(f"{', '.join(c.name for c in waiting)} not ready after {timeout:.0f} s; "
                                  f"{self.log_dir / (waiting[0].name + '.log')}: "
                                  f"{last_line(self.log_dir / (waiting[0].name + '.log'))}")
            # A death wakes this at once; the ready flags have no doorbell, hence the slice.
            wait([c.process.sentinel for c in waiting], timeout=min(left, _READY_SLICE_S))

    def death(self, child: Child, when: str = "") -> str:
        """One line: which process died, how, and the last line of its log."""
        log = self.log_dir / f"{child.name}.log"
        what = f"{child.name} (rank {child.rank}, pid {child.process.pid})"
        line = f"{what} {describe_exit(child.process.exitcode)} {when}".rstrip() + f"; {log}: {last_line(log)}"
        if not log.exists():  # it died before its entry point ran, most often re-importing the script
            line += ("; it never reached its entry point: if the serving script calls launch() when imported, "
                     + SPAWN_GUARD)
        return line

    # -- watching ----------------------------------------------------------------------
    def restart_transfer(self, child: Child, why: str) -> Child:
        """Replaces a dead transfer process (its ready flag back to STARTING, its generation
        bumped first: that is what tells the engine to fail the rank's copies in flight)."""
        assert self.signals is not None, "restart before setup"
        child.process.join()
        self.signals[f"{child.name}.ready"] = STARTING
        self.signals.add(f"{child.name}.gen", 1)
        new = self.start("transfer", child.rank)
        new.restarts = child.restarts + 1
        self.say(f"{child.name} {why}; restarted (gen {self.signals[f'{child.name}.gen']})")
        return new

    def why_dead(self, child: Child, now_ns: int) -> str | None:
        """None while ``child`` lives; else how it died (exited, a silent heartbeat, never ready)."""
        assert self.signals is not None, "watch before setup"
        if child.process.exitcode is not None:
            return describe_exit(child.process.exitcode)
        if self.signals[f"{child.name}.ready"] != STARTING:
            silent = now_ns - max(self.signals[f"{child.name}.beat"], child.started_ns)
            if silent > self.spec.dead_after_s * 1e9:
                return f"heartbeat silent for {silent / 1e9:.1f} s"
        elif now_ns - child.started_ns > self.startup_timeout_s * 1e9:
            return f"not ready after {self.startup_timeout_s:.0f} s"
        return None

    def watch(self) -> None:
        """Starts the watcher thread: replaces dead transfer processes until ``close``."""
        self._wake_r, self._wake_w = os.pipe()
        self._watcher = threading.Thread(target=self._watch, name="fastkv-launch-watch", daemon=True)
        self._watcher.start()

    def _watch(self) -> None:
        # This thread also starts the replacements: they die with it (PR_SET_PDEATHSIG is per
        # thread), so it lives until close() has stopped them.
        while True:
            live = [c for c in list(self.children.values()) if c.role == "transfer" and c.process.exitcode is None]
            wait([*(c.process.sentinel for c in live), self._wake_r], timeout=self.spec.heartbeat_s)
            if self._closing:
                self._joined.wait()
                return
            if self.failure is not None:
                continue
            now = time.monotonic_ns()
            for child in [c for c in list(self.children.values()) if c.role == "transfer"]:
                why = self.why_dead(child, now)
                if why is None or self._closing:
                    continue
                if child.process.exitcode is None:  # hung: make it dead before replacing it
                    child.process.kill()
                    child.process.join()
                if child.process.exitcode == 0:  # the engine closed its end: a clean finish, not a death
                    continue
                # a stop signal (a group SIGTERM from systemd, a pod stop, `timeout`) is obeyed, not repaired
                stopped = -(child.process.exitcode or 0) in STOP_SIGNALS
                if stopped or child.restarts >= self.max_restarts:
                    self.stop(self.death(child, "(a stop signal: not restarted)" if stopped
                                         else f"after {child.restarts} restarts"))
                    self.say(self.failure)
                    break
                self.restart_transfer(child, why)

    def stop(self, reason: str) -> None:
        """Ends the run from any thread or signal handler: ``stop`` is set, so the engine raises
        ``EngineStopped`` at its next wait (within ``spec.heartbeat_s``) and every process exits;
        ``failure`` says why. For a server with its own SIGTERM handler (``handle_signals=False``)."""
        if self.failure is None:  # nothing printed: a signal handler may interrupt a print
            self.failure = reason
        if self.signals is not None:
            self.signals["stop"] = 1

    # -- teardown ----------------------------------------------------------------------
    def shutdown(self, grace_s: float | None = None) -> None:
        """``stop`` = 1; every process started gets ``grace_s`` in all (default
        ``join_timeout_s``) to exit, then SIGKILL; one still starting is SIGTERMed at once (it
        holds no work). With ``grace_s`` (a stop signal: the whole run must end within seconds),
        one still running then gets SIGTERM and ``_TERM_GRACE_S`` more before the SIGKILL."""
        self._closing = True
        if self.signals is not None:
            self.signals["stop"] = 1
        if self._wake_w >= 0:
            os.write(self._wake_w, b"x")  # the watcher stops restarting
        started = [c for c in self.children.values() if c.process.pid is not None]
        for child in started:
            if child.process.exitcode is None and self.signals is not None \
                    and self.signals[f"{child.name}.ready"] == STARTING:
                child.process.terminate()
        wait_s = self.join_timeout_s if grace_s is None else grace_s
        deadline = time.monotonic() + wait_s
        for child in started:
            child.process.join(max(0.0, deadline - time.monotonic()))
        late = [c for c in started if c.process.exitcode is None]
        if late and grace_s is not None:  # a worker deep in a long call (a weight load) gets a signal
            for child in late:
                child.process.terminate()
            deadline = time.monotonic() + _TERM_GRACE_S
            for child in late:
                child.process.join(max(0.0, deadline - time.monotonic()))
        for child in late:
            if child.process.exitcode is None:
                self.say(f"{child.name} ignored stop for {wait_s:.0f} s; killing")
                child.process.kill()
                child.process.join()
        self._joined.set()
        if self._watcher is not None:
            self._watcher.join()
            self._watcher = None

    def teardown(self) -> None:
        """Unlinks everything of the run (tiers, channels, signals, manifest)."""
        if self.signals is not None:
            self.signals.close()
            self.signals = None
        for tier in self._tiers:
            tier.close()
            tier.unlink()
        self._tiers = []
        if self.ns is not None:  # also unlinks a worker-made (CUDA) device tier: its name is in the manifest
            self.ns.close()
            self.ns = None
        for fd in (self._wake_r, self._wake_w):
            if fd >= 0:
                os.close(fd)
        self._wake_r = self._wake_w = -1

    def close(self, grace_s: float | None = None) -> None:
        self.shutdown(grace_s)
        self.teardown()


def ensure_ops() -> None:
    """Builds the swap ops unless this machine has them, before any process needs them."""
    from fastkv.kernels import ops

    if ops.find() is None:
        ops.build()


@contextmanager
def launch(spec: RunSpec, *, start_transfers: bool | None = None, watch: bool = True, handle_signals: bool = True,
           **options: Any) -> Iterator[Launch]:
    """Sets up the run of ``spec`` and yields its ``Launch``; stops and unlinks everything on
    the way out (module docstring). ``options``: ``Launch``'s keyword arguments.

    start_transfers: start the transfer processes and wait until they are up (LaunchError
    naming a rank that died meanwhile); default: yes unless the workers make the device tiers.
    watch: replace dead transfer processes from a thread. handle_signals: SIGTERM (and
    SIGINT, already) unwind the block, so nothing is left behind (main thread only)."""
    from fastkv.transfer.tiers import _cuda_available

    # Importing Paddle (which this does) replaces the C-level SIGTERM handler: ours goes in after.
    cuda = _cuda_available()
    run = Launch(spec, **options)
    if start_transfers is None:
        start_transfers = not (run.device_tiers == "worker" or (run.device_tiers == "auto" and cuda))
    handled = handle_signals and threading.current_thread() is threading.main_thread()
    old: dict[int, Any] = {}
    if handled:
        def stop(signum: int, _frame: Any) -> None:
            why = f"stopped by {signal.Signals(signum).name}"
            run.stop(why)  # an engine driven from another thread stops too
            raise_stop(SystemExit(f"fastkv: {why}"))

        old[signal.SIGTERM] = signal.signal(signal.SIGTERM, stop)
    try:
        ensure_ops()
        run.setup(cuda)
        if start_transfers:
            run.start_transfers()
        if watch:
            run.watch()
        yield run
    finally:
        clear_stop()  # the stop, if any, has unwound to here
        if handled:  # a second SIGTERM or Ctrl-C must not cut the clean-up short: it only says stop
            def noted(signum: int, _frame: Any) -> None:
                run.stop(f"stopped by {signal.Signals(signum).name}")

            for sig in (signal.SIGTERM, signal.SIGINT):
                old.setdefault(sig, signal.signal(sig, noted))
        try:
            # a stop (a signal, run.stop) or a Ctrl-C: the run ends within seconds, whatever a child is doing
            stopping = run.failure is not None or isinstance(sys.exc_info()[1], KeyboardInterrupt)
            run.close(_SIGNAL_GRACE_S if stopping else None)
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)

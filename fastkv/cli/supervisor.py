"""The supervisor: creates a run's shared memory, starts its processes, watches them, cleans up.

One ``Supervisor`` is one run::

    result = Supervisor(spec, "fastkv-out/workload.jsonl").run()   # blocks until done

``run()`` first builds fastkv's swap ops if this machine has never built them (one line on
stderr; SIGINT/SIGTERM abort the build, leaving nothing behind), so no child builds them under
its heartbeat. It then removes what dead runs left behind (``cleanup_stale``), creates the namespace, the
channels (``fastkv.run.create_run``) and the KV tiers of every rank (all through ``fastkv.launch.Launch``,
the set-up an embedding deployment gets from ``launch``), starts the engine, one
worker and one transfer process per rank (``multiprocessing`` spawn; entry points in
``ENTRY_POINTS``), and waits. It never sleep-polls: it blocks on the children's process
sentinels and a self-pipe that the SIGINT/SIGTERM handler writes, with timeout
``spec.heartbeat_s``, and after each wake-up checks heartbeats in the signal array.

- The engine exiting 0 means the workload is done: the run succeeded.
- A transfer process that dies (exit, signal, or a heartbeat silent for ``spec.dead_after_s``)
  is replaced: ``transfer{r}.gen`` is bumped first, so the engine's TransferClient fails the
  tasks in flight on that rank (their requests recompute), then a new process attaches to
  the same channels and tiers (the tiers belong to the supervisor and outlive it).
- A dead worker or engine fails the run, naming the process, how it died and its last log lines.
- SIGINT/SIGTERM set ``stop``; the children get ``join_timeout_s`` to exit, then SIGKILL (at once
  on a second signal).

Whatever happens, everything is unlinked at the end (tiers, channels, signals, manifest),
and ``summary.json`` and ``results.jsonl`` exist: when the engine did not write them, the
supervisor does (``fastkv.engine.engine.write_missing``: every request unfinished).
Paddle is imported before the signal handlers go in (its import replaces the C-level SIGTERM
handler with one that exits at once), so no signal finds shared memory without our handler
(the CLI imports it earlier still, before it writes anything).
Children get PR_SET_PDEATHSIG(SIGKILL), so a SIGKILLed supervisor takes its children with it;
its shared memory is then removed by the next supervisor start or ``fastkv-supervisor --cleanup``.
Each child's stdout/stderr goes to ``<out_dir>/logs/<name>.log``.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any, NamedTuple

from fastkv.engine.engine import write_missing
from fastkv.ipc import Namespace, SignalArray
from fastkv.ipc.namespace import SHM_DIR
from fastkv.launch import Launch
from fastkv.procs.children import Child, _child_main, describe_exit, log_tail, resolve  # noqa: F401 (re-exported)
from fastkv.run import STARTING, RunSpec

ENTRY_POINTS = {
    "engine": "fastkv.engine.engine:main",  # main(spec_json, workload_path) -> int
    "worker": "fastkv.engine.worker:main",  # main(spec_json, rank) -> int
    "transfer": "fastkv.transfer.process:main",  # main(spec_json, rank) -> int
}


class _Interrupted(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


class RunResult(NamedTuple):
    ok: bool
    message: str  # "workload done", or what failed / who stopped the run
    exit_codes: dict[str, int | None]  # per process name, after shutdown
    restarts: dict[str, int]  # transfer process name -> times restarted
    seconds: float


class Supervisor:
    """One run: ``Supervisor(spec, workload_path).run()``.

    entry_points: role -> "module:function", overriding ``ENTRY_POINTS`` (tests, a deployment's
    own worker). progress: a callable ``(finished, total)`` called after every wake-up (the CLI's
    progress bar), or None. max_restarts: per transfer rank, before the run fails.
    startup_timeout_s: how long a process may take to set its ready flag (Paddle imports are slow).
    """

    def __init__(
        self,
        spec: RunSpec,
        workload_path: str | Path,
        *,
        entry_points: dict[str, str] | None = None,
        progress: Callable[[int, int], None] | None = None,
        max_restarts: int = 3,
        startup_timeout_s: float = 180.0,
        join_timeout_s: float = 15.0,
        manifest_dir: str | Path = SHM_DIR,
    ) -> None:
        if not isinstance(spec, RunSpec):
            raise TypeError(f"spec must be a RunSpec, got {type(spec).__name__}")
        unknown = set(entry_points or {}) - set(ENTRY_POINTS)
        if unknown:
            raise ValueError(f"unknown roles in entry_points: {sorted(unknown)}; roles are {sorted(ENTRY_POINTS)}")
        self.workload_path = Path(workload_path).resolve()
        if not self.workload_path.is_file():
            raise ValueError(f"workload file {str(self.workload_path)!r} does not exist")
        if max_restarts < 0 or startup_timeout_s <= 0 or join_timeout_s <= 0:
            raise ValueError("need max_restarts >= 0, startup_timeout_s > 0 and join_timeout_s > 0")
        self.spec = spec
        self.out_dir = Path(spec.out_dir).resolve()
        self.log_dir = self.out_dir / "logs"
        self.entry_points = {**ENTRY_POINTS, **(entry_points or {})}
        self.progress = progress
        self.max_restarts = max_restarts
        self.startup_timeout_s = startup_timeout_s
        self.join_timeout_s = join_timeout_s
        self.manifest_dir = Path(manifest_dir)
        self.children: dict[str, Child] = {}
        self.ns: Namespace | None = None
        self.signals: SignalArray | None = None
        self._run: Launch | None = None
        self._ctx = mp.get_context("spawn")
        self._stop_reason: str | None = None
        self._stopping = False
        self._kill_now = False
        self._wake_r, self._wake_w = -1, -1

    # -- the run -----------------------------------------------------------------------
    def run(self) -> RunResult:
        t0 = time.monotonic()
        from fastkv.transfer.tiers import _cuda_available

        # Importing Paddle (which this does) replaces the C-level SIGTERM handler with one that
        # exits at once: ours go in after it, and before any shared memory exists.
        cuda = _cuda_available()
        failed = self._build_ops()
        if failed is not None:
            return RunResult(False, failed, {}, {}, time.monotonic() - t0)
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_w, False)
        old_handlers = self._install_handlers()
        ok, message = False, "the supervisor failed"
        try:
            try:
                self._setup(cuda)
            except MemoryError as exc:  # a tier that does not fit: nothing started
                message = str(exc)
            else:
                if self._stop_reason is None:  # a signal during setup: nothing to start
                    for rank in range(self.spec.tp_size):
                        self._start("transfer", rank)
                        self._start("worker", rank)
                    self._start("engine", 0)
                ok, message = self._watch()
            finally:  # also on an exception (the caller sees it): stop everything, unlink everything
                self._shutdown()
                codes = {c.name: c.process.exitcode for c in self.children.values()}
                restarts = {c.name: c.restarts for c in self.children.values() if c.role == "transfer"}
                self._teardown()
                status = "done" if ok else "stopped" if self._stop_reason else f"failed: {message.splitlines()[0]}"
                if write_missing(self.out_dir, self.workload_path, status):
                    print(f"fastkv-supervisor: the engine wrote no summary; wrote {self.out_dir / 'summary.json'} "
                          f"({status})", file=sys.stderr)
        finally:
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)
        return RunResult(ok, message, codes, restarts, time.monotonic() - t0)

    def request_stop(self, reason: str = "stop requested") -> None:
        """Ends the run cleanly (signal-handler safe: records the reason, wakes the watcher)."""
        if self._stopping:
            self._kill_now = True  # asked again while shutting down: do not wait for the children
        elif self._stop_reason is None:
            self._stop_reason = reason
        if self._wake_w >= 0:
            try:
                os.write(self._wake_w, b"x")
            except BlockingIOError:
                return  # the pipe is full: the watcher has wake-ups queued already

    # -- setup and teardown ------------------------------------------------------------
    def _build_ops(self) -> str | None:
        """Builds the swap ops unless built (first run on a machine), before anything else exists,
        so no process builds them under its heartbeat; returns why that failed, or None."""
        from fastkv.kernels import ops

        if ops.find() is not None:
            return None
        print("fastkv-supervisor: building the swap ops for this machine (first run, ~15 s) ...", end="",
              file=sys.stderr, flush=True)
        t0 = time.monotonic()

        def interrupt(signum: int, _frame: Any) -> None:
            raise _Interrupted(signum)

        old_handlers = self._install_handlers(interrupt)
        try:
            ops.build()
        except _Interrupted as exc:
            print(" interrupted", file=sys.stderr)
            return f"interrupted by {signal.Signals(exc.signum).name} while building the swap ops"
        except Exception as exc:
            print(" failed", file=sys.stderr)
            return f"building the swap ops failed: {exc}"
        finally:
            for signum, handler in old_handlers.items():
                signal.signal(signum, handler)
        print(f" done in {time.monotonic() - t0:.1f} s", file=sys.stderr)
        return None

    def _setup(self, cuda: bool) -> None:
        # The set-up an embedding deployment gets from fastkv.launch; this loop watches the children.
        self._run = Launch(self.spec, log_dir=self.log_dir, manifest_dir=self.manifest_dir,
                           entry_points=self.entry_points, mp_context=self._ctx, max_restarts=self.max_restarts,
                           startup_timeout_s=self.startup_timeout_s, join_timeout_s=self.join_timeout_s,
                           say=lambda text: print(f"fastkv-supervisor: {text}", file=sys.stderr))
        self.children = self._run.children
        self._run.setup(cuda)
        self.ns, self.signals = self._run.ns, self._run.signals

    def _teardown(self) -> None:
        self.signals = self.ns = None
        if self._run is not None:
            self._run.teardown()
        fds, (self._wake_r, self._wake_w) = (self._wake_r, self._wake_w), (-1, -1)  # first: a late signal skips it
        for fd in fds:
            if fd >= 0:
                os.close(fd)

    def _install_handlers(self, handler: Callable[[int, Any], None] | None = None) -> dict[int, Any]:
        """SIGINT/SIGTERM -> ``handler`` (default: ``request_stop``); returns the old handlers."""
        import threading

        if threading.current_thread() is not threading.main_thread():
            return {}  # only the main thread may set handlers; the caller uses request_stop()

        def stop(signum: int, _frame: Any) -> None:
            self.request_stop(f"interrupted by {signal.Signals(signum).name}")

        return {signum: signal.signal(signum, handler or stop) for signum in (signal.SIGINT, signal.SIGTERM)}

    # -- children ----------------------------------------------------------------------
    def _start(self, role: str, rank: int) -> Child:
        assert self._run is not None, "start before setup"
        args = (self.spec.to_json(), str(self.workload_path)) if role == "engine" else None
        return self._run.start(role, rank, args=args)

    def _restart_transfer(self, child: Child, why: str) -> None:
        assert self._run is not None, "restart before setup"
        self._run.restart_transfer(child, why)

    def _watch(self) -> tuple[bool, str]:
        """Until the engine exits 0 (True), a stop request or a fatal death (False, why)."""
        assert self.signals is not None, "watch before setup"
        finished: set[str] = set()  # ranks that exited 0: the engine closed their channels, it is finishing
        while True:
            # The engine first: once it exited 0, ranks exiting with it are no failure.
            live = [c for c in self.children.values() if c.name not in finished]
            live.sort(key=lambda c: c.role != "engine")
            woken = wait([*(c.process.sentinel for c in live), self._wake_r], timeout=self.spec.heartbeat_s)
            if self._wake_r in woken:
                os.read(self._wake_r, 4096)
            if self._stop_reason is not None:
                return False, self._stop_reason
            self._report_progress()
            now = time.monotonic_ns()
            for child in live:
                why = self._why_dead(child, now)
                if why is None:
                    continue
                if child.process.exitcode is None:  # hung: make it dead before replacing it
                    child.process.kill()
                    child.process.join()
                if child.process.exitcode == 0:
                    if child.role == "engine":
                        self._report_progress()
                        return True, "workload done"
                    finished.add(child.name)
                elif child.role == "transfer" and child.restarts < self.max_restarts:
                    self._restart_transfer(child, why)
                else:
                    log = self.log_dir / f"{child.name}.log"
                    extra = f" after {child.restarts} restarts" if child.restarts else ""
                    return False, f"{child.name} (pid {child.process.pid}) {why}{extra}; {log}:\n{log_tail(log)}"

    def _why_dead(self, child: Child, now_ns: int) -> str | None:
        """None while ``child`` lives; else how it died (exited, or a silent heartbeat, or never ready)."""
        assert self._run is not None, "watch before setup"
        return self._run.why_dead(child, now_ns)

    def _report_progress(self) -> None:
        if self.progress is not None and self.signals is not None:
            self.progress(self.signals["engine.finished"], self.signals["engine.total"])

    def _shutdown(self) -> None:
        """stop = 1, SIGTERM to children not ready yet, give every child join_timeout_s in all (none if asked
        to stop twice), SIGKILL the rest."""
        self._stopping = True
        if self.signals is not None:
            self.signals["stop"] = 1
        deadline = time.monotonic() + self.join_timeout_s
        # a child whose start failed part-way (pid None) has no sentinel and nothing to join
        started = [c.process for c in self.children.values() if c.process.pid is not None]
        running = [p for p in started if p.exitcode is None]
        for child in self.children.values():
            # Still starting (importing, attaching): it holds no work and would see stop only once
            # up; its default SIGTERM ends it now (what it attached, the supervisor unlinks). One
            # that is EXITING is releasing what it attached: it gets its time.
            if child.process in running and (self.signals is None or self.signals[f"{child.name}.ready"] == STARTING):
                child.process.terminate()
        while running and not self._kill_now:
            left = deadline - time.monotonic()
            if left <= 0:
                print(f"fastkv-supervisor: {[p.name for p in running]} ignored stop for {self.join_timeout_s:.0f} s; "
                      "killing", file=sys.stderr)
                break
            woken = wait([*(p.sentinel for p in running), self._wake_r], timeout=left)
            if self._wake_r in woken:
                os.read(self._wake_r, 4096)
            running = [p for p in running if p.exitcode is None]
        for proc in running:
            proc.kill()
        for proc in started:
            proc.join()

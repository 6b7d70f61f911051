"""Process identity and liveness, for peer-death detection and stale-run cleanup.

A pid alone is not an identity: pids are reused, and a SIGKILLed child stays a zombie
(``os.kill(pid, 0)`` still succeeds) until its parent reaps it. So a process is
identified by (pid, start time in clock ticks since boot, from /proc/<pid>/stat) and
counts as alive only while that /proc entry exists, is not a zombie, and has the same
start time.
"""
from __future__ import annotations

import ctypes
import os
import select
import signal
from typing import NamedTuple

_PR_SET_PDEATHSIG = 1


def _stat_fields(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name (field 2) may contain spaces and parens: split after the last ')'.
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int:
    """Start time of ``pid`` in clock ticks since boot; 0 when unknown (no /proc)."""
    fields = _stat_fields(pid)
    return int(fields[19]) if fields else 0


def pid_alive(pid: int, started: int = 0) -> bool:
    """True while ``pid`` runs (not a zombie) and, when ``started`` is given, is the same
    process that had that start time."""
    if pid <= 0:
        return False
    if not os.path.isdir("/proc/self"):  # no procfs: fall back to signal 0 (zombies count as alive)
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = _stat_fields(pid)
    if fields is None or fields[0] in ("Z", "X", "x"):
        return False
    return not started or int(fields[19]) == started


def exit_status(pid: int) -> int | None:
    """How ``pid`` ended while it is a zombie (its parent has not reaped it yet), as
    multiprocessing says it: the exit code, or minus the signal that killed it; else None."""
    fields = _stat_fields(pid)
    if fields is None or fields[0] != "Z" or len(fields) < 50:
        return None
    status = int(fields[49])  # field 52, exit_code: the status waitpid() would report
    return -(status & 0x7F) if status & 0x7F else status >> 8


def wait_exit(pid: int, timeout: float) -> bool:
    """Block until ``pid`` has ended (exited or a zombie), at most ``timeout`` s, on its pidfd:
    no polling. True when it has."""
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        ended, _, _ = select.select([fd], [], [], timeout)
        return bool(ended)
    finally:
        os.close(fd)


class Peer(NamedTuple):
    """Who is on one end of a ring: a role name (engine, worker, transfer...), a rank and
    the process identity."""

    role: str
    rank: int
    pid: int
    started: int

    def alive(self) -> bool:
        return pid_alive(self.pid, self.started)

    def describe(self) -> str:
        return f"{self.role or '?'}[{self.rank}] pid {self.pid}" if self.pid else "an unregistered peer"


def me(role: str, rank: int) -> Peer:
    pid = os.getpid()
    return Peer(role, rank, pid, start_time(pid))


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> None:
    """Has the kernel send ``sig`` to this process when ``parent_pid`` (its parent) dies;
    exits at once if the parent died before this took effect."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent_pid:
        os._exit(1)

"""The child processes of a run: the spawned body (dies with its parent, logs to a file, calls
an entry point ``"module:function"``), and how to say how one died."""
from __future__ import annotations

import importlib
import os
import signal
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastkv.ipc.peers import die_with_parent
from fastkv.procs.proctitle import set_title


@dataclass(slots=True)
class Child:
    name: str  # engine, worker{r}, transfer{r}
    role: str
    rank: int
    process: Any  # multiprocessing SpawnProcess
    started_ns: int
    restarts: int = 0


def resolve(target: str) -> Callable[..., int]:
    """``"package.module:function"`` -> the function."""
    module, _, func = target.partition(":")
    if not module or not func:
        raise ValueError(f"entry point must be 'module:function', got {target!r}")
    return getattr(importlib.import_module(module), func)


def _child_main(target: str, args: tuple, parent_pid: int, log_path: str, title: tuple = ()) -> None:
    """Runs in the spawned child: die with the supervisor, log to a file, call the entry point.
    ``title``: ``(role, rank, run_id)`` for ``fastkv.procs.proctitle.set_title``."""
    die_with_parent(parent_pid)
    if title:
        set_title(*title)
    # Ctrl-C reaches the whole process group; only the supervisor decides how to stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    sys.exit(resolve(target)(*args))


# Signals that ask a process to stop: a child they killed is not restarted
STOP_SIGNALS = frozenset({signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT})


def last_line(path: Path) -> str:
    """The last non-empty line of a log, or what stands in for it."""
    try:
        lines = path.read_text(errors="replace").rstrip().splitlines()
    except FileNotFoundError:
        return "(no log)"
    return lines[-1].strip() if lines else "(empty log)"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "still running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def log_tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return "(no log)"
    tail = text.rstrip().splitlines()[-lines:]
    return "\n".join("    " + line for line in tail) if tail else "(empty log)"

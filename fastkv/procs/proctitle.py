"""Process titles, so that ``ps`` and ``top`` tell fastkv's processes apart.

A spawned child otherwise shows as ``python -c from multiprocessing.spawn import spawn_main …``.
``set_title("transfer", 0, "1a2b")`` makes it ``fastkv transfer[0] run 1a2b``; the engine and
the supervisor, one per run, show no rank: ``fastkv engine run 1a2b``.
"""
from __future__ import annotations

import setproctitle

UNRANKED = ("engine", "supervisor")  # one per run: no rank in the title


def title(role: str, rank: int | None, run_id: str) -> str:
    who = role if rank is None or role in UNRANKED else f"{role}[{rank}]"
    return f"fastkv {who} run {run_id}"


def set_title(role: str, rank: int | None, run_id: str) -> None:
    """Sets this process's title (``/proc/<pid>/cmdline``, what ``ps`` shows) and its name
    (``/proc/<pid>/comm``, what ``top`` shows: its first 15 characters)."""
    setproctitle.setproctitle(title(role, rank, run_id))

"""Session-wide test policy.

* Hypothesis: the ``ci`` profile (selected when CI is set) runs a fixed (derandomized) set of
  500 examples per property or state machine; the ``dev`` profile runs 60 fresh random ones.
* Leaks: every fastkv shared-memory object and semaphore is named ``fkv*`` and lives in
  /dev/shm (semaphores as ``sem.fkv*``). The session fails if any is left behind, so a
  test or shutdown path that leaks, even after SIGKILL, is caught. Only this session's runs
  count: objects of a run whose manifest names another live owner (another fastkv run or
  test session on the machine) are not ours to judge.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

settings.register_profile(
    # derandomize: CI runs the same 500 examples on every run, so a rare case a local run finds
    # is reported with its example instead of turning CI red at random; dev runs keep exploring
    "ci", max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))

SHM_DIR = Path("/dev/shm")


def fastkv_shm_objects() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(("fkv", "sem.fkv"))}


def _run_id(name: str) -> str | None:
    """The run of a namespace object (``fkv.<run>.<name>``, ``sem.fkv.<run>.<name>``)."""
    parts = name.removeprefix("sem.").split(".")
    return parts[1] if parts[0] == "fkv" and len(parts) > 2 else None


def _owned_elsewhere(run_id: str) -> bool:
    """True when ``run_id``'s manifest names a live owner other than this process.

    Our own children are dead by the session's end, and runs this process owns have us as
    owner, so anything left by this session still counts; a concurrent run does not."""
    from fastkv.ipc.peers import pid_alive

    try:
        doc = json.loads((SHM_DIR / f"fkv.{run_id}.manifest.json").read_text())
        pid, started = int(doc["owner_pid"]), int(doc.get("owner_started", 0))
    except (OSError, ValueError, KeyError, TypeError):
        return False  # no readable manifest: a stray object, whoever made it
    return pid != os.getpid() and pid_alive(pid, started)


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    before = fastkv_shm_objects()
    yield
    leaked = {n for n in fastkv_shm_objects() - before if _run_id(n) is None or not _owned_elsewhere(_run_id(n))}
    assert not leaked, f"fastkv shared-memory objects left in /dev/shm: {sorted(leaked)}"

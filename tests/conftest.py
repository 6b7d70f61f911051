"""Session-wide test policy.

* Hypothesis: the ``ci`` profile (selected when CI is set) runs a fixed (derandomized) set of
  500 examples per property or state machine: each test's seed is a hash of its source, so every
  machine and every PYTHONHASHSEED draws the same examples (strategies never order by set
  iteration or enum names). The ``dev`` profile runs 60 fresh random ones, and ``long``
  (HYPOTHESIS_PROFILE=long, with --timeout 0; ``scripts/hunt.sh`` runs it) 10,000 per machine,
  the randomized hunt to take before stopping work ($FASTKV_LONG_EXAMPLES: another count); it
  saves failures in the example database at $FASTKV_HYPOTHESIS_DB (default .hypothesis/examples),
  which replays them first, and $FASTKV_HUNT_SEED seeds every test (``pytest_collection_modifyitems``).
* Leaks: every fastkv shared-memory object and semaphore is named ``fkv*`` and lives in
  /dev/shm (semaphores as ``sem.fkv*``). The session fails if any is left behind, so a
  test or shutdown path that leaks, even after SIGKILL, is caught. Only this session's runs
  count: objects of a run whose manifest names another live owner (another fastkv run or
  test session on the machine) are not ours to judge.
"""
from __future__ import annotations

import json
import os
import uuid
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.database import DirectoryBasedExampleDatabase

settings.register_profile(
    # derandomize: CI runs the same 500 examples on every run, so a rare case a local run finds
    # is reported with its example instead of turning CI red at random; dev runs keep exploring
    "ci", max_examples=500, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(
    "dev", max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile(  # before stopping work: scripts/hunt.sh (about 30 minutes on 2 cores)
    "long", max_examples=int(os.environ.get("FASTKV_LONG_EXAMPLES", 10_000)), deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    database=DirectoryBasedExampleDatabase(os.environ.get("FASTKV_HYPOTHESIS_DB", ".hypothesis/examples")),
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci" if os.environ.get("CI") else "dev"))


def pytest_collection_modifyitems(items):
    """$FASTKV_HUNT_SEED (scripts/hunt.sh): every property test and state machine draws from that
    seed, as ``@seed`` would make it; unlike --hypothesis-seed, the example database stays on,
    so a failure is saved and the same seed and database replay it."""
    hunt = os.environ.get("FASTKV_HUNT_SEED")
    if not hunt:
        return
    from hypothesis.stateful import RuleBasedStateMachine

    machines, seen = [RuleBasedStateMachine], set()
    while machines:
        cls = machines.pop()
        for sub in cls.__subclasses__():
            if sub not in seen:
                seen.add(sub)
                machines.append(sub)
                sub._hypothesis_internal_use_seed = int(hunt)
    for item in items:
        test = getattr(item, "obj", None)
        if getattr(test, "is_hypothesis_test", False):
            getattr(test, "__func__", test)._hypothesis_internal_use_seed = int(hunt)

SHM_DIR = Path("/dev/shm")


def fastkv_shm_objects() -> set[str]:
    if not SHM_DIR.is_dir():
        return set()
    return {p.name for p in SHM_DIR.iterdir() if p.name.startswith(("fkv", "sem.fkv"))}


def _run_id(name: str) -> str | None:
    """The run of a namespace object (``fkv.<run>.<name>``, ``sem.fkv.<run>.<name>``)."""
    parts = name.removeprefix("sem.").split(".")
    return parts[1] if parts[0] == "fkv" and len(parts) > 2 else None


def _shm_file(kind: str, name: str) -> str:
    """/dev/shm's name of a POSIX object: ``/fkv.x`` is ``fkv.x`` (shm) or ``sem.fkv.x`` (sem)."""
    return ("sem." if kind == "sem" else "") + name.lstrip("/")


def held_elsewhere() -> tuple[set[str], set[str]]:
    """(run ids, object files) of the live runs another process owns: their manifests list
    their own objects and the ones they share with other runs (a PD handoff's semaphore).

    Our own children are dead by the session's end, and runs this process owns have us as
    owner, so anything left by this session still counts; a concurrent run does not."""
    from fastkv.ipc.peers import pid_alive

    runs: set[str] = set()
    files: set[str] = set()
    for path in SHM_DIR.glob("fkv.*.manifest.json"):
        try:
            doc = json.loads(path.read_text())
            pid, started = int(doc["owner_pid"]), int(doc.get("owner_started", 0))
            objects = [_shm_file(kind, name) for kind, name in doc.get("objects", [])]
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no readable manifest: its objects are strays, whoever made them
        if pid != os.getpid() and pid_alive(pid, started):
            runs.add(str(doc.get("run_id")))
            files.update(objects)
    return runs, files


def shm_test_name() -> str:
    """A name for a test's own shared-memory objects outside any run (collectives): it carries
    this session's pid, so a session beside ours does not count them as its leaks."""
    return f"fkvtest{os.getpid()}x{uuid.uuid4().hex[:8]}"


def _other_session(name: str) -> bool:
    """A test object (``shm_test_name``) of another live test session."""
    from fastkv.ipc.peers import pid_alive

    head = name.removeprefix("sem.").removeprefix("fkvtest").split("x", 1)[0]
    return head.isdigit() and int(head) != os.getpid() and pid_alive(int(head))


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    before = fastkv_shm_objects()
    yield
    runs, files = held_elsewhere()
    leaked = {n for n in fastkv_shm_objects() - before
              if n not in files and _run_id(n) not in runs and not _other_session(n)}
    assert not leaked, f"fastkv shared-memory objects left in /dev/shm: {sorted(leaked)}"

"""Session-wide test policy.

* Hypothesis: the ``ci`` profile (selected when CI is set) runs a fixed (derandomized) set of
  500 examples per property or state machine; the ``dev`` profile runs 60 fresh random ones.
* Leaks: every fastkv shared-memory object and semaphore is named ``fkv*`` and lives in
  /dev/shm (semaphores as ``sem.fkv*``). The session fails if any is left behind, so a
  test or shutdown path that leaks, even after SIGKILL, is caught.
"""
from __future__ import annotations

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


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    before = fastkv_shm_objects()
    yield
    leaked = fastkv_shm_objects() - before
    assert not leaked, f"fastkv shared-memory objects left in /dev/shm: {sorted(leaked)}"

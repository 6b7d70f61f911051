"""The session leak check (tests/conftest.py) judges only this session's objects: a live run
of another process (its own objects, the ones it shares) and another test session's
collectives are not ours; a dead run's objects and strays are."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid

from fastkv.ipc.peers import start_time
from tests.conftest import SHM_DIR, _other_session, held_elsewhere, shm_test_name


def _manifest(run_id: str, pid: int, objects: list) -> str:
    path = SHM_DIR / f"fkv.{run_id}.manifest.json"
    path.write_text(json.dumps({"run_id": run_id, "owner_pid": pid, "owner_started": start_time(pid),
                                "objects": objects}))
    return path


def test_a_live_run_of_another_process_holds_its_objects_and_the_ones_it_shares():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    live, dead = f"t{uuid.uuid4().hex[:10]}", f"t{uuid.uuid4().hex[:10]}"
    paths = [_manifest(live, other.pid, [["shm", f"/fkv.{live}.ring"], ["sem", "/fkv.pdabc.handoff"]]),
             _manifest(dead, 2 ** 22 + 7, [["shm", f"/fkv.{dead}.ring"]])]
    try:
        runs, files = held_elsewhere()
        assert live in runs and dead not in runs
        assert {f"fkv.{live}.ring", "sem.fkv.pdabc.handoff"} <= files and f"fkv.{dead}.ring" not in files
        _manifest(live, os.getpid(), [["shm", f"/fkv.{live}.ring"]])  # ours: judged
        assert live not in held_elsewhere()[0]
    finally:
        other.kill()
        other.wait()
        for p in paths:
            p.unlink()


def test_another_live_sessions_collective_is_not_ours_a_dead_ones_is():
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        mine = shm_test_name()
        assert not _other_session(mine) and not _other_session("sem." + mine + ".0.1")
        assert _other_session(mine.replace(str(os.getpid()), str(other.pid), 1))
    finally:
        other.kill()
        other.wait()
    assert not _other_session(mine.replace(str(os.getpid()), str(other.pid), 1))
    assert not _other_session("fkvtest862d6552")  # the old names: a stray

from __future__ import annotations

import json
import os
import signal
import stat

import pytest

from fastkv.ipc import Channel, Doorbell, Namespace, SignalArray, cleanup, cleanup_stale, list_runs, stale_runs
from tests.ipc.helpers import CTX, SHM, reap, run_objects


def test_objects_are_0600_prefixed_listed_and_unlinked(ns):
    ch = Channel.create(ns, "task.0", slot_size=64, nslots=4)
    sig = SignalArray.create(ns, "signals", ["hb.engine"])
    names = run_objects(ns.run_id)
    assert names == sorted([
        f"fkv.{ns.run_id}.manifest.json", f"fkv.{ns.run_id}.signals", f"fkv.{ns.run_id}.task.0",
        f"fkv.{ns.run_id}.task.0.data", f"fkv.{ns.run_id}.task.0.space",
        f"sem.fkv.{ns.run_id}.task.0.data", f"sem.fkv.{ns.run_id}.task.0.space",
    ])
    for name in names:
        assert stat.S_IMODE((SHM / name).stat().st_mode) == 0o600, name
    manifest = json.loads(ns.manifest_path.read_text())
    assert manifest["owner_pid"] == os.getpid()
    listed = {name for _, name in manifest["objects"]}
    assert listed == {f"/fkv.{ns.run_id}.{n}" for n in ("task.0", "task.0.data", "task.0.space", "signals")}
    ch.close()
    sig.close()
    ns.close()
    assert run_objects(ns.run_id) == []


def test_attached_namespace_cannot_create_and_names_are_checked(ns):
    other = Namespace.attach(ns.run_id)
    with pytest.raises(ValueError, match="attached"):
        Doorbell.create(other, "x")
    with pytest.raises(ValueError, match="object name"):
        ns.name("../etc")
    with pytest.raises(ValueError, match="run id"):
        Namespace.attach("has/slash")
    with pytest.raises(ValueError, match="already exists"):
        Namespace.create(ns.run_id)


def test_cleanup_refuses_a_live_owner(ns):
    Doorbell.create(ns, "bell").close()
    assert any(r.run_id == ns.run_id and r.alive for r in list_runs())
    assert ns.run_id not in {r.run_id for r in stale_runs()}
    with pytest.raises(ValueError, match="live pid"):
        cleanup(ns.run_id)


def _crashing_owner(conn):
    ns = Namespace.create()
    Channel.create(ns, "task.0", slot_size=64, nslots=8)
    Channel.create(ns, "task.1", slot_size=64, nslots=8)
    SignalArray.create(ns, "signals", ["a", "b"])
    conn.send(ns.run_id)
    signal.pause()


def test_cleanup_after_sigkilled_owner():
    parent, child = CTX.Pipe()
    p = CTX.Process(target=_crashing_owner, args=(child,), daemon=True)
    p.start()
    assert parent.poll(10), "owner did not start"
    run_id = parent.recv()
    try:
        assert len(run_objects(run_id)) == 12  # manifest, signals, 2 x (ring + 2 bells: 3 shm + 2 sem)
        os.kill(p.pid, signal.SIGKILL)
        reap(p)
        assert run_id in {r.run_id for r in stale_runs()}
        removed = cleanup_stale()
        assert f"/fkv.{run_id}.task.1" in removed and f"/fkv.{run_id}.task.0.data" in removed
        assert run_objects(run_id) == []
        assert run_id not in {r.run_id for r in list_runs()}
    finally:
        p.kill()
        cleanup(run_id, force=True)


def test_cleanup_by_manifest_path_sweeps_unlisted_leftovers():
    ns = Namespace.create()
    Doorbell.create(ns, "bell").close()
    (SHM / f"fkv.{ns.run_id}.stray").write_bytes(b"x")  # e.g. a crash between create and record
    removed = cleanup(ns.manifest_path, force=True)
    assert f"/fkv.{ns.run_id}.bell" in removed and f"fkv.{ns.run_id}.stray" in removed
    assert run_objects(ns.run_id) == []
    ns.close()  # idempotent after cleanup: nothing left to unlink


def _dead_run(manifest_dir, run_id: str) -> None:
    """A manifest as a crashed owner leaves it (pid 2**22 + 1 is above pid_max: never alive)."""
    (manifest_dir / f"fkv.{run_id}.manifest.json").write_text(json.dumps(
        {"run_id": run_id, "owner_pid": 2**22 + 1, "owner_started": 0, "created": 0, "objects": []}))


def test_other_users_and_unreadable_runs_are_skipped_with_a_warning(tmp_path):
    _dead_run(tmp_path, "theirs1")
    os.chown(tmp_path / "fkv.theirs1.manifest.json", 4242, 4242)  # another uid's run (as root: still readable)
    os.chmod(tmp_path / "fkv.theirs1.manifest.json", 0o600)
    (tmp_path / "fkv.garbled1.manifest.json").write_text("{not json")
    _dead_run(tmp_path, "mine1")
    with pytest.warns(UserWarning) as caught:
        runs = list_runs(tmp_path)
        removed = cleanup_stale(tmp_path)
    assert [r.run_id for r in runs] == ["mine1"] and removed == []
    text = " ".join(str(w.message) for w in caught)
    assert "theirs1" in text and "another user's" in text and "garbled1" in text
    assert not (tmp_path / "fkv.mine1.manifest.json").exists()  # cleaned
    assert (tmp_path / "fkv.theirs1.manifest.json").exists()  # never touched


def test_one_failing_cleanup_does_not_stop_the_others(tmp_path, monkeypatch):
    import fastkv.ipc.namespace as namespace

    for run_id in ("stale1", "stale2", "stale3"):
        _dead_run(tmp_path, run_id)
    real = namespace.cleanup

    def cleanup(run, manifest_dir, force=False):
        if "stale2" in str(run):
            raise PermissionError(13, "Permission denied", str(run))
        return real(run, manifest_dir, force)

    monkeypatch.setattr(namespace, "cleanup", cleanup)
    with pytest.warns(UserWarning, match="stale2.*Permission denied"):
        cleanup_stale(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fkv.stale2.manifest.json"]

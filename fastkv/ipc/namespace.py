"""Per-run namespace of shared-memory objects, its manifest, and crash cleanup.

Every object a run creates is named ``/fkv.<run_id>.<local name>`` (in /dev/shm a shm
segment shows as ``fkv.<run_id>.<name>``, a semaphore as ``sem.fkv.<run_id>.<name>``),
is created exclusively with mode 0600, and is recorded in the run's manifest
``<manifest_dir>/fkv.<run_id>.manifest.json`` *before* it is created, so a crash between
the two leaves nothing the manifest does not list. The owner (the supervisor; a test)
unlinks everything and removes the manifest in ``close()``; ``cleanup()`` does the same
for a run whose owner died, and ``stale_runs()`` finds those runs.

Manifest (JSON): ``{"run_id", "owner_pid", "owner_started", "created", "objects":
[["shm" | "sem", "/fkv.<run_id>.<name>"], ...]}``; rewritten atomically (tmp + rename).
"""
from __future__ import annotations

import json
import mmap
import os
import re
import secrets
import time
import warnings
from pathlib import Path
from typing import NamedTuple

import posix_ipc

from fastkv.ipc.peers import pid_alive, start_time

SHM_DIR = Path("/dev/shm")
PREFIX = "fkv"
_LOCAL_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_RUN_ID = re.compile(r"^[A-Za-z0-9]{1,32}$")


def _check_run_id(run_id: str) -> str:
    if not isinstance(run_id, str) or not _RUN_ID.match(run_id):
        raise ValueError(f"run id must be 1-32 letters/digits, got {run_id!r}")
    return run_id


class Namespace:
    """Creates (owner) or opens (attached) the shared-memory objects of one run.

    ``Namespace.create()`` in the owning process, ``Namespace.attach(run_id)`` in the
    others; pass ``ns.run_id`` to children. Only the creating process unlinks (a forked
    child that inherits the object does not).
    """

    def __init__(self, run_id: str, owner: bool, manifest_dir: Path) -> None:
        self.run_id = _check_run_id(run_id)
        self.owner = owner
        self.manifest_dir = Path(manifest_dir)
        self.prefix = f"{PREFIX}.{run_id}"
        self._owner_pid = os.getpid()
        self._objects: list[tuple[str, str]] = []
        self._closed = False

    # -- lifetime ----------------------------------------------------------------------
    @classmethod
    def create(cls, run_id: str | None = None, manifest_dir: str | Path = SHM_DIR) -> Namespace:
        ns = cls(run_id or secrets.token_hex(4), True, Path(manifest_dir))
        if ns.manifest_path.exists():
            raise ValueError(f"run {ns.run_id!r} already exists ({ns.manifest_path})")
        ns._write_manifest()
        return ns

    @classmethod
    def attach(cls, run_id: str, manifest_dir: str | Path = SHM_DIR) -> Namespace:
        return cls(run_id, False, Path(manifest_dir))

    @property
    def manifest_path(self) -> Path:
        return self.manifest_dir / f"{self.prefix}.manifest.json"

    def close(self) -> None:
        """Owner: unlink every object of the run and remove the manifest. Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self.owner and os.getpid() == self._owner_pid:
            _unlink_all(self._objects)
            self.manifest_path.unlink(missing_ok=True)

    def __enter__(self) -> Namespace:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- objects -----------------------------------------------------------------------
    def name(self, local: str) -> str:
        if not isinstance(local, str) or not _LOCAL_NAME.match(local):
            raise ValueError(f"object name must match {_LOCAL_NAME.pattern}, got {local!r}")
        return f"/{self.prefix}.{local}"

    def create_shm(self, local: str, size: int) -> mmap.mmap:
        """Create a zero-filled shm segment of ``size`` bytes (0600) and map it."""
        if not isinstance(size, int) or size <= 0:
            raise ValueError(f"shm size must be a positive int, got {size!r}")
        name = self._record("shm", local)
        shm = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o600, size=size)
        try:
            return mmap.mmap(shm.fd, size)
        finally:
            shm.close_fd()

    def open_shm(self, local: str) -> mmap.mmap:
        """Map an existing segment of this run (its whole size)."""
        shm = posix_ipc.SharedMemory(self.name(local))
        try:
            return mmap.mmap(shm.fd, shm.size)
        finally:
            shm.close_fd()

    def create_sem(self, local: str, initial: int = 0) -> posix_ipc.Semaphore:
        name = self._record("sem", local)
        return posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600, initial_value=initial)

    def open_sem(self, local: str) -> posix_ipc.Semaphore:
        return posix_ipc.Semaphore(self.name(local))

    def record(self, kind: str, local: str) -> str:
        """List an object that another module creates under this run (the KV tier segments)
        in the manifest *before* it is created; returns its full name (``/fkv.<run>.<local>``)."""
        if kind not in ("shm", "sem"):
            raise ValueError(f"object kind must be 'shm' or 'sem', got {kind!r}")
        return self._record(kind, local)

    def record_shared(self, kind: str, name: str) -> None:
        """List an object this run shares with another under its own full name (both list it):
        unlinked with the run's own objects; one still open elsewhere lives on there."""
        if kind not in ("shm", "sem") or not name.startswith(f"/{PREFIX}."):
            raise ValueError(f"a shared object is ('shm' | 'sem', '/{PREFIX}.*'), got {(kind, name)!r}")
        if not self.owner:
            raise ValueError(f"namespace {self.run_id!r} is attached, not owned: only its owner lists objects")
        self._objects.append((kind, name))
        self._write_manifest()

    def _record(self, kind: str, local: str) -> str:
        if not self.owner:
            raise ValueError(f"namespace {self.run_id!r} is attached, not owned: only its owner creates objects")
        if self._closed:
            raise ValueError(f"namespace {self.run_id!r} is closed")
        name = self.name(local)
        self._objects.append((kind, name))
        self._write_manifest()  # before creating: a crash in between leaves nothing unlisted
        return name

    def _write_manifest(self) -> None:
        doc = {
            "run_id": self.run_id,
            "owner_pid": self._owner_pid,
            "owner_started": start_time(self._owner_pid),
            "created": time.time(),
            "objects": self._objects,
        }
        tmp = self.manifest_path.with_name(self.manifest_path.name + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(doc, f)
        os.replace(tmp, self.manifest_path)


class RunInfo(NamedTuple):
    run_id: str
    owner_pid: int
    alive: bool
    manifest: Path


def _unlink_all(objects: list[tuple[str, str]]) -> list[str]:
    removed = []
    for kind, name in reversed(objects):
        unlink = posix_ipc.unlink_shared_memory if kind == "shm" else posix_ipc.unlink_semaphore
        try:
            unlink(name)
            removed.append(name)
        except posix_ipc.ExistentialError:
            continue  # already gone (never created, or unlinked by an earlier cleanup)
    return removed


def list_runs(manifest_dir: str | Path = SHM_DIR) -> list[RunInfo]:
    """This user's runs. Another user's run (its manifest is theirs, mode 0600) and a manifest
    that cannot be read or parsed are skipped with a warning: never a reason to fail."""
    runs = []
    for path in sorted(Path(manifest_dir).glob(f"{PREFIX}.*.manifest.json")):
        try:
            if path.stat().st_uid != os.getuid():
                warnings.warn(f"skipping {path}: another user's fastkv run", stacklevel=2)
                continue
            doc = json.loads(path.read_text())
            pid = int(doc["owner_pid"])
            runs.append(RunInfo(doc["run_id"], pid, pid_alive(pid, int(doc.get("owner_started", 0))), path))
        except FileNotFoundError:
            continue  # its owner closed it meanwhile
        except (OSError, ValueError, KeyError, TypeError) as exc:
            warnings.warn(f"skipping unreadable fastkv manifest {path}: {exc}", stacklevel=2)
    return runs


def stale_runs(manifest_dir: str | Path = SHM_DIR) -> list[RunInfo]:
    """Runs whose owner process is dead (their objects are garbage)."""
    return [r for r in list_runs(manifest_dir) if not r.alive]


def cleanup(run: str | Path, manifest_dir: str | Path = SHM_DIR, force: bool = False) -> list[str]:
    """Remove every object of a run, given its run id or its manifest path; returns the
    names removed. Uses the manifest, then (Linux) sweeps /dev/shm for the run's prefix.
    Refuses a run whose owner is alive unless ``force``."""
    path = Path(run) if str(run).endswith(".manifest.json") else Path(manifest_dir) / f"{PREFIX}.{run}.manifest.json"
    removed: list[str] = []
    run_id = path.name[len(PREFIX) + 1 : -len(".manifest.json")]
    _check_run_id(run_id)
    if path.exists():
        doc = json.loads(path.read_text())
        if not force and pid_alive(int(doc["owner_pid"]), int(doc.get("owner_started", 0))):
            raise ValueError(f"run {run_id!r} is owned by live pid {doc['owner_pid']}; pass force=True to remove it")
        removed += _unlink_all([tuple(o) for o in doc["objects"]])
    if SHM_DIR.is_dir():
        for entry in SHM_DIR.glob(f"*{PREFIX}.{run_id}.*"):
            if entry.name.startswith((f"{PREFIX}.{run_id}.", f"sem.{PREFIX}.{run_id}.")) and entry != path:
                entry.unlink(missing_ok=True)
                removed.append(entry.name)
    path.with_name(path.name + ".tmp").unlink(missing_ok=True)
    path.unlink(missing_ok=True)
    return removed


def cleanup_stale(manifest_dir: str | Path = SHM_DIR) -> list[str]:
    """Cleanup of every run whose owner is dead (the supervisor's ``--cleanup``), best effort:
    a run that cannot be cleaned is reported with a warning and the others still are."""
    removed = []
    for run in stale_runs(manifest_dir):
        try:
            removed += cleanup(run.manifest, manifest_dir)
        except (OSError, ValueError, posix_ipc.Error) as exc:
            warnings.warn(f"could not clean up fastkv run {run.run_id} ({run.manifest}): {exc}", stacklevel=2)
    return removed

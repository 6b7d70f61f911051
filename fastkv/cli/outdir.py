"""A run's output directory: one run at a time, and only fastkv's own files ever removed.

``OutDir.claim(path, run_id)`` creates the directory if needed and takes an exclusive
``flock`` on ``<path>/.fastkv.lock``, which then holds ``{"run_id", "pid"}`` of the run. The
lock lives as long as the ``OutDir`` (the supervisor process holds it for the whole run);
the kernel drops it when that process dies, so the lock file of a dead run is simply taken
over, and a live run's lock is refused with a ValueError naming the directory, the run and
its pid. The lock file also marks the directory as fastkv's: ``clear_previous`` removes a
previous run's output files only in a directory that had one, and refuses to write over
same-named files in any other.

The default LMDB store ``<path>/store`` is marked with ``store/.fastkv-store`` when fastkv
creates it; ``fresh_store`` clears only a store with that mark, and refuses any other
``store`` (it may be the user's: nothing of it is touched).
"""
from __future__ import annotations

import fcntl
import json
import os
import shutil
from pathlib import Path

LOCK = ".fastkv.lock"
STORE_MARK = ".fastkv-store"
# What a run writes at the top of its directory (logs/ only appends, one file per process).
OUTPUTS = ("results.jsonl", "summary.json", "report.json", "report.png", "workload.jsonl", "spec.json",
           "metrics.prom")


class OutDir:
    """The claimed output directory of one run (see the module docstring)."""

    def __init__(self, path: Path, run_id: str, fd: int, fastkvs: bool) -> None:
        self.path, self.run_id, self._fd = path, run_id, fd
        self.was_fastkvs = fastkvs  # the lock file was there before: a previous run's directory
        self.cleared = False  # clear_previous() is done: every output file here is this run's

    @classmethod
    def claim(cls, path: str | Path, run_id: str) -> OutDir:
        path = Path(path).resolve()
        if path.exists() and not path.is_dir():
            raise ValueError(f"--out {path} is not a directory")
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--out {path} cannot be created: {exc.strerror}") from None
        lock = path / LOCK
        existed = lock.exists()
        try:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        except OSError as exc:
            raise ValueError(f"--out {path} is not writable: {exc.strerror}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read_holder(fd)
            os.close(fd)
            raise ValueError(f"--out {path} is in use by run {holder.get('run_id', '?')} "
                             f"(pid {holder.get('pid', '?')}): give this run another --out") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"run_id": run_id, "pid": os.getpid()}).encode() + b"\n", 0)
        return cls(path, run_id, fd, existed)

    def clear_previous(self) -> None:
        """Remove a previous run's output files, so a file left from it cannot pass for this
        run's; in a directory fastkv never ran in, refuse to overwrite same-named files."""
        found = [name for name in OUTPUTS if (self.path / name).exists()]
        if found and not self.was_fastkvs:
            raise ValueError(f"--out {self.path} holds {', '.join(found)} not written by fastkv (no {LOCK}): "
                             "give this run another --out")
        for name in found:
            (self.path / name).unlink()
        self.cleared = True

    def fresh_store(self) -> Path:
        """An empty ``store/`` marked as fastkv's: a previous fastkv store is cleared (runs
        stay comparable); any other ``store`` is refused."""
        store = self.path / "store"
        if store.exists() or store.is_symlink():
            if not (store / STORE_MARK).is_file() or store.is_symlink():
                raise ValueError(f"--out {self.path}: {store} was not created by fastkv; not touching it: "
                                 "give this run another --out or set --storage")
            shutil.rmtree(store)
        store.mkdir()
        (store / STORE_MARK).write_text("created by fastkv-supervisor: cleared at the start of each run\n")
        return store

    def release(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # drops the flock; the file stays, marking the directory as fastkv's
            self._fd = -1

    def __enter__(self) -> OutDir:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _read_holder(fd: int) -> dict:
    try:
        doc = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}  # the holder is between truncate and write
    return doc if isinstance(doc, dict) else {}

"""The handoff file as a live stream between a prefill and a decode run started together.

``handoff.jsonl`` holds a header ``{"header": {"pid", "started"}}`` (the prefill engine
process, ``fastkv.ipc.peers.start_time``), one record per request (``fastkv.engine.handoff``)
and, when the prefill run ends, ``{"end": STATUS}``. The writer (``Announcer``) posts a
POSIX named semaphore after each line it appends; the reader (``Follower``) blocks on it with
a timeout, so it never sleeps to poll. The semaphore is named after the file's resolved path
(``fastkv.run.handoff_sem``), so both runs find it whichever starts first; each run lists it in its
manifest (``fastkv.run.create_run``), so its supervisor unlinks it at the end and the stale-run
cleanup after a crash. A post lost to that unlink costs only latency: the reader also reads
the file on every timeout. On a timeout the reader checks that the header's process lives:
a prefill run that died without its end record ends the decode run with one line.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import posix_ipc

from fastkv.ipc.peers import pid_alive, start_time
from fastkv.ipc.semwait import acquire
from fastkv.run import handoff_sem


def _open_sem(path: str | Path) -> posix_ipc.Semaphore:
    return posix_ipc.Semaphore(handoff_sem(path), posix_ipc.O_CREAT, mode=0o600, initial_value=0)


class Announcer:
    """The prefill side: a fresh file with its header; ``append`` lines, ``end`` it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._sem = _open_sem(self.path)
        pid = os.getpid()
        self.path.write_text(json.dumps({"header": {"pid": pid, "started": start_time(pid)}}) + "\n")
        self._sem.release()

    def append(self, docs: list[dict[str, Any]]) -> None:
        with self.path.open("a") as f:
            f.write("".join(json.dumps(d) + "\n" for d in docs))
        self._sem.release()

    def end(self, status: str) -> None:
        self.append([{"end": status}])
        self._sem.close()


class Follower:
    """The decode side: the records appended since the last ``read``; ``wait`` for more."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._sem = _open_sem(self.path)
        self._buf, self._offset, self._line = b"", 0, 0
        self.header: dict[str, Any] | None = None
        self.end: str | None = None  # the prefill run's status once it ended
        self.records = 0

    def read(self) -> list[dict[str, Any]]:
        """New request records (``id``, ``ok``, ...); ValueError naming ``file:line`` of a bad one."""
        try:
            with self.path.open("rb") as f:
                f.seek(self._offset)
                chunk = f.read()
        except FileNotFoundError:
            return []  # the prefill run has not started yet
        self._offset += len(chunk)
        *lines, self._buf = (self._buf + chunk).split(b"\n")  # a line being written stays in the buffer
        out = []
        for line in lines:
            self._line += 1
            doc = self._parse(line)
            if "header" in doc:
                self.header = doc["header"]
            elif "end" in doc:
                self.end = str(doc["end"])
            else:
                out.append(doc)
        self.records += len(out)
        return out

    def _parse(self, line: bytes) -> dict[str, Any]:
        try:
            doc = json.loads(line)
            if not isinstance(doc, dict):
                raise ValueError("not an object")
            if "header" not in doc and "end" not in doc and (
                    not isinstance(doc.get("id"), str) or not isinstance(doc.get("ok"), bool)):
                raise ValueError("needs a string 'id' and a bool 'ok'")
        except ValueError as exc:
            raise ValueError(f"{self.path}:{self._line}: not a handoff record ({exc})") from None
        return doc

    def _posted(self, timeout: float) -> bool:
        """The prefill side posted within ``timeout`` (False: it timed out, a time to check on it)."""
        return acquire(self._sem, timeout)

    def wait(self, timeout: float) -> str | None:
        """Block until the prefill side appends (or ``timeout``); None, or on a timeout after
        which the prefill run is gone without ending the file, the line that says so."""
        if self._posted(timeout):
            return None
        h = self.header
        if h is None or self.end is not None or pid_alive(int(h["pid"]), int(h.get("started", 0))):
            return None
        self.read()  # what it wrote before it died
        if self.end is not None:
            return None
        return (f"the prefill run (engine pid {h['pid']}) died before ending {self.path}: "
                f"{self.records} requests were handed off")

    def close(self) -> None:
        self._sem.close()

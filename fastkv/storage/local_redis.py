"""A redis-server on 127.0.0.1 for the storage tests and ``scripts/bench_storage.py``.

``start()`` blocks until the server logs "Ready to accept connections": a thread reads
the server's stdout line by line (a blocking read, no polling) and keeps the last lines
for the error message when a start fails. The server can be killed (SIGKILL), paused
(SIGSTOP) and started again on the same port.
"""
from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import threading
from collections import deque
from pathlib import Path

READY = b"Ready to accept connections"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalRedis:
    def __init__(self, workdir: str | Path, password: str | None = None, binary: str | None = None) -> None:
        self.binary = binary or shutil.which("redis-server")
        if self.binary is None:
            raise FileNotFoundError("redis-server is not installed (Debian: apt-get install redis-server)")
        self.workdir = Path(workdir)
        self.password = password
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self._log: deque[bytes] = deque(maxlen=50)

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        assert self.proc is None, "redis-server already running"
        args = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", str(self.workdir)]
        if self.password:
            args += ["--requirepass", self.password]
        self.proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        ready = threading.Event()
        threading.Thread(target=self._drain, args=(self.proc, ready), daemon=True).start()
        if not ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            log = b"".join(self._log).decode(errors="replace")
            raise RuntimeError(f"redis-server on port {self.port} did not start within {timeout} s:\n{log}")

    def _drain(self, proc: subprocess.Popen, ready: threading.Event) -> None:
        """Keeps the server's stdout pipe from filling up; sets ``ready`` at the ready line or at EOF."""
        for line in proc.stdout:
            self._log.append(line)
            if READY in line:
                ready.set()
        proc.stdout.close()
        ready.set()  # EOF: the server exited; start() sees it through poll()

    def kill(self) -> None:
        """SIGKILL: the server dies without closing anything."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None

    def pause(self) -> None:
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        self.proc.send_signal(signal.SIGCONT)

    def client(self):
        import redis

        return redis.Redis(port=self.port, password=self.password, socket_timeout=2)

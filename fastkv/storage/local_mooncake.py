"""A single-machine Mooncake pool on 127.0.0.1: ``mooncake_master`` and one holder process
(mooncake_holder.py) that lends the pool ``segment_size`` bytes. Tests, the benchmark and
``--storage mooncake://local[?segment_size=1G]`` (a pool of the run's own) use it; a pool
that outlives supervisors runs in the foreground with

    python -m fastkv.storage.local_mooncake --segment-size 4G     # prints the URL to give --storage

Both processes die with the process that started them (PR_SET_PDEATHSIG, and the holder
also at the end of its stdin), so a crash leaves no master running.

Every port is an explicit free loopback port (the master's defaults would collide between
runs). ``start()`` blocks on the processes' own output (a reader thread per process, no
polling) until the master logs that it serves and the holder says ``ready``. The master
and the holder can each be killed (SIGKILL) and the holder started again.
"""
from __future__ import annotations

import argparse
import ctypes
import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import threading
from collections import deque
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

from fastkv.storage.local_redis import free_port

MASTER_READY = b"Master admin server started"


def master_binary() -> str | None:
    """The ``mooncake_master`` the installed client ships (the console script is only a wrapper)."""
    spec = importlib.util.find_spec("mooncake")
    for folder in (spec.submodule_search_locations or []) if spec else []:
        path = Path(folder) / "mooncake_master"
        if path.is_file():
            return str(path)
    return shutil.which("mooncake_master")


def master_metadata_flags(host: str, port: int) -> list[str]:
    """mooncake_master's flags for its HTTP metadata server on ``host:port`` (port 0: none, the
    transfer engines then find each other by P2P handshake); README gives the same line."""
    if not port:
        return ["--enable_http_metadata_server=false"]
    return ["--enable_http_metadata_server=true", f"--http_metadata_server_host={host}",
            f"--http_metadata_server_port={port}"]


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGKILL it when the parent dies."""
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class _Proc:
    def __init__(self, name: str, args: list[str], ready: bytes, stdin: bool = False,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.log: deque[bytes] = deque(maxlen=40)
        self.proc = subprocess.Popen(args, stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, preexec_fn=_die_with_parent,
                                     env=env)
        self._ready = threading.Event()
        self._marker = ready
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)
            if self._marker in line:
                self._ready.set()
        self.proc.stdout.close()
        self._ready.set()  # EOF: it exited; wait_ready() sees that through poll()

    def wait_ready(self, timeout: float) -> None:
        if not self._ready.wait(timeout) or self.proc.poll() is not None:
            self.kill()
            out = b"".join(self.log).decode(errors="replace")
            raise RuntimeError(f"{self.name} did not start within {timeout} s:\n{out}")

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)
        if self.proc.stdin is not None:
            self.proc.stdin.close()

    def stop(self, timeout: float = 5.0) -> None:
        """Closes the holder's stdin (it unmounts and exits); SIGKILL if it does not."""
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()


class LocalMooncake:
    """``mooncake_master`` plus one holder on 127.0.0.1; ``url`` is what engines open."""

    def __init__(self, segment_size: int = 256 << 20, lease_ttl_ms: int = 200, client_ttl_s: int = 2,
                 binary: str | None = None, http_metadata: bool = False) -> None:
        """``http_metadata``: the master also serves the transfer engines' metadata over HTTP
        (what a deployment without P2P handshakes runs); the holder and the URL use it."""
        self.binary = binary or master_binary()
        if self.binary is None:
            raise FileNotFoundError("mooncake_master is not installed: pip install -e '.[mooncake]'")
        self.segment_size = segment_size
        self.lease_ttl_ms = lease_ttl_ms
        self.client_ttl_s = client_ttl_s
        self.port = free_port()
        self.metrics_port = free_port()
        self.http_port = free_port() if http_metadata else 0
        self.master: _Proc | None = None
        self.holder: _Proc | None = None

    @classmethod
    def from_url(cls, url: str) -> LocalMooncake:
        """``mooncake://local[?segment_size=1G]`` (the holder's segment; default 1 GiB)."""
        from fastkv.storage.sizes import parse_size

        parts = urlsplit(url)
        if parts.netloc != "local" or parts.path not in ("", "/"):
            raise ValueError(f"not a local Mooncake pool URL: {url!r} (mooncake://local[?segment_size=1G])")
        opts = dict(parse_qsl(parts.query, keep_blank_values=True))
        unknown = set(opts) - {"segment_size"}
        if unknown:
            raise ValueError(f"unknown option {sorted(unknown)[0]!r} in storage URL {url!r}; known: ['segment_size']")
        try:
            size = parse_size(opts.get("segment_size", "1G"))
        except ValueError as exc:
            raise ValueError(f"bad value for 'segment_size' in storage URL {url!r}: {exc}") from None
        return cls(segment_size=size, lease_ttl_ms=1000, client_ttl_s=5)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata" if self.http_port else "P2PHANDSHAKE"

    @property
    def url(self) -> str:
        query = {"metadata_server": self.metadata_server, "local_hostname": "127.0.0.1", "protocol": "tcp",
                 "global_segment_size": "0"}
        return f"mooncake://{self.address}?{urlencode(query)}"

    def start(self, timeout: float = 15.0) -> None:
        self.start_master(timeout)
        try:
            self.start_holder(timeout)
        except BaseException:
            self.stop()
            raise

    def start_master(self, timeout: float = 15.0) -> None:
        assert self.master is None or self.master.proc.poll() is not None, "mooncake_master already running"
        args = [self.binary, f"--rpc_port={self.port}", "--rpc_address=127.0.0.1",
                f"--metrics_port={self.metrics_port}", "--metrics_host=127.0.0.1",
                f"--default_kv_lease_ttl={self.lease_ttl_ms}", f"--client_ttl={self.client_ttl_s}",
                *master_metadata_flags("127.0.0.1", self.http_port), "--logtostderr"]
        # its INFO line says when it serves, whatever GLOG_minloglevel the user runs with
        env = {**os.environ, "GLOG_minloglevel": "0"}
        self.master = _Proc(f"mooncake_master on {self.address}", args, MASTER_READY, env=env)
        self.master.wait_ready(timeout)

    def start_holder(self, timeout: float = 15.0) -> None:
        assert self.holder is None or self.holder.proc.poll() is not None, "holder already running"
        args = [sys.executable, "-m", "fastkv.storage.mooncake_holder", self.address, str(self.segment_size),
                "--metadata-server", self.metadata_server, "--local-hostname", "127.0.0.1", "--protocol", "tcp"]
        self.holder = _Proc(f"Mooncake holder of {self.segment_size} bytes", args, b"ready", stdin=True)
        self.holder.wait_ready(timeout)

    def kill_master(self) -> None:
        if self.master is not None:
            self.master.kill()

    def kill_holder(self) -> None:
        if self.holder is not None:
            self.holder.kill()

    def stop(self) -> None:
        """The holder first (it unmounts its segment at the master), then the master."""
        if self.holder is not None:
            self.holder.stop()
            self.holder = None
        if self.master is not None:
            self.master.kill()
            self.master = None

    def __enter__(self) -> LocalMooncake:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    from fastkv.storage.sizes import parse_size

    p = argparse.ArgumentParser(prog="python -m fastkv.storage.local_mooncake", description=__doc__.split("\n\n")[0])
    p.add_argument("--segment-size", default="1G", help="memory the holder lends the pool (e.g. 4G)")
    p.add_argument("--lease-ms", type=int, default=1000, help="the master's lease on a value read")
    args = p.parse_args(argv)
    try:
        pool = LocalMooncake(parse_size(args.segment_size), lease_ttl_ms=args.lease_ms, client_ttl_s=5)
        pool.start()
    except (ValueError, OSError, RuntimeError) as exc:
        print(f"local_mooncake: {str(exc).splitlines()[0]}", file=sys.stderr)
        return 2
    print(pool.url, flush=True)
    try:
        signal.sigwait({signal.SIGINT, signal.SIGTERM})
    finally:
        pool.stop()
    return 0


if __name__ == "__main__":
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    sys.exit(main())

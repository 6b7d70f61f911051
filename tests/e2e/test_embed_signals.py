"""A serving process built from the docs (serve_script.py) stops when told and fails fast when a
worker dies: SIGTERM to the process or to its whole process group at each stage unwinds within 5 s,
restarts nothing and leaves nothing in /dev/shm; a worker that dies at start-up or mid-run fails the
engine within 5 s naming it and its log's last line; a script without the ``__main__`` guard is told so."""
from __future__ import annotations

import os
import random
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 5.0


class Server:
    """serve_script.py in a session of its own (its own process group, as under systemd)."""

    def __init__(self, tmp_path: Path, *args: str) -> None:
        self.err_path = tmp_path / "stderr.txt"
        self.err = open(self.err_path, "w")  # noqa: SIM115 (closed in wait)
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.e2e.serve_script", str(tmp_path / "out"), *args],
                                     stdout=subprocess.PIPE, stderr=self.err, text=True, cwd=ROOT,
                                     env={**os.environ, "PYTHONPATH": str(ROOT)}, start_new_session=True)
        self.run_id = self.expect("run ").split()[1]

    def expect(self, prefix: str, timeout: float = 90.0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith(prefix):
                return line.strip()
        pytest.fail(f"no {prefix!r} line from the server; stderr: {self.stderr()[-2000:]}")

    def stderr(self) -> str:
        if not self.err.closed:
            self.err.flush()
        return self.err_path.read_text(errors="replace")

    def signal(self, sig: int, group: bool) -> float:
        if group:
            os.killpg(self.proc.pid, sig)
        else:
            self.proc.send_signal(sig)
        return time.monotonic()

    def wait(self, timeout: float = 60.0) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            self.err.close()

    def leftovers(self) -> list[str]:
        return sorted(p.name for p in Path("/dev/shm").iterdir() if f"fkv.{self.run_id}." in p.name)


def stops_cleanly(server: Server, sent: float, tmp_path: Path) -> None:
    rc = server.wait()
    took = time.monotonic() - sent
    err = server.stderr()
    logs = "".join(p.read_text(errors="replace") for p in (tmp_path / "out" / "logs").glob("*.log"))
    assert rc != 0, f"the server ran to its end (rc 0) despite the signal; stderr: {err[-1500:]}"
    assert took < STOP_WITHIN_S, f"{took:.1f} s from the signal to the exit; stderr: {err[-1500:]}"
    assert "; restarted (gen" not in err + logs, err[-1500:]
    assert server.leftovers() == [], server.leftovers()


@pytest.mark.parametrize("group", [False, True], ids=["process", "group"])
def test_sigterm_while_waiting_until_ready(tmp_path, group):
    server = Server(tmp_path, "--tp", "2", "--start-delay", "3")
    server.expect("phase wait")
    stops_cleanly(server, server.signal(signal.SIGTERM, group), tmp_path)


@pytest.mark.parametrize("group", [False, True], ids=["process", "group"])
def test_sigterm_while_streaming_stops_every_time(tmp_path, group):
    rng = random.Random(7)
    for i in range(10):
        run_dir = tmp_path / f"r{i}"
        run_dir.mkdir()
        server = Server(run_dir, "--step-ms", "10")
        server.expect("phase stream")
        time.sleep(rng.uniform(0.0, 1.0))
        stops_cleanly(server, server.signal(signal.SIGTERM, group), run_dir)


@pytest.mark.parametrize("group", [False, True], ids=["process", "group"])
def test_sigterm_while_updating_weights(tmp_path, group):
    server = Server(tmp_path, "--tp", "2", "--load-s", "8", "--updates", "1")  # a load far longer than 5 s
    server.expect("phase update")
    time.sleep(0.5)
    stops_cleanly(server, server.signal(signal.SIGTERM, group), tmp_path)


def test_sigint_to_the_group_stops_it_too(tmp_path):
    server = Server(tmp_path, "--step-ms", "10")
    server.expect("phase stream")
    stops_cleanly(server, server.signal(signal.SIGINT, True), tmp_path)


def _fails_naming_the_worker(server: Server, rank: int, log_line: str) -> None:
    """The engine's error, the server's last line, names the worker and quotes its log's last
    line, which says when it died: the engine failed within STOP_WITHIN_S of that."""
    failed = float(server.expect("engine failed at ").split()[3].rstrip(":"))
    rc = server.wait()
    last = server.stderr().strip().splitlines()[-1]
    assert rc != 0
    assert re.match(rf"fastkv.engine.core.EngineError: worker{rank} \(rank {rank}, pid \d+\) exited with code 1; ",
                    last), last
    assert f"worker{rank}.log: {log_line}" in last, last
    died = float(re.search(r"\(on purpose\) at ([0-9.]+)$", last).group(1))
    assert failed - died < STOP_WITHIN_S, f"{failed - died:.1f} s from the death to the engine's error"
    assert server.leftovers() == []


def test_a_worker_that_dies_at_start_up_fails_the_wait_within_5_s(tmp_path):
    server = Server(tmp_path, "--tp", "2", "--die", "startup", "--die-rank", "1")
    server.expect("phase wait")
    _fails_naming_the_worker(server, 1, "RuntimeError: worker 1 cannot load its model (on purpose)")


def test_a_worker_that_dies_mid_run_fails_the_engine_within_5_s(tmp_path):
    server = Server(tmp_path, "--tp", "2", "--die", "midrun", "--die-rank", "1", "--step-ms", "20")
    server.expect("phase stream")
    _fails_naming_the_worker(server, 1, "RuntimeError: worker 1 lost its device at step")


def test_a_script_without_the_main_guard_is_told_in_one_line(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(textwrap.dedent(f"""
        import uuid
        from fastkv.config import KVLayout
        from fastkv.launch import launch
        from fastkv.run import RunSpec

        spec = RunSpec(f"ug{{uuid.uuid4().hex[:8]}}", KVLayout(1, 1, 4, 8, "float32"), 8, 8,
                       out_dir={str(tmp_path / "out")!r})
        with launch(spec) as run:
            print("launched")
    """))
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert proc.returncode != 0 and "launched" not in proc.stdout
    assert time.monotonic() - t0 < 60
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fastkv.launch.LaunchError: transfer0") and 'if __name__ == "__main__":' in last, last


def test_a_second_sigterm_during_the_clean_up_does_not_cut_it_short(tmp_path):
    server = Server(tmp_path, "--tp", "2", "--step-ms", "10")
    server.expect("phase stream")
    sent = server.signal(signal.SIGTERM, False)
    for _ in range(5):  # more stop signals while it unwinds: each only says stop again
        time.sleep(0.1)
        if server.proc.poll() is None:
            server.signal(signal.SIGTERM, False)
            server.signal(signal.SIGINT, False)
    stops_cleanly(server, sent, tmp_path)

"""The supervisor against stand-in engine/worker/transfer processes (tests/e2e/standins.py):
clean runs, signals, restarts, crashes, and that nothing is ever left in /dev/shm."""
from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from fastkv.cli import JobConfig, prepare
from fastkv.cli.supervisor import Supervisor
from fastkv.ipc import Namespace, SignalArray, pid_alive
from tests.e2e.standins import ENTRIES

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]
SHM = Path("/dev/shm")
SMALL = ["--layers", "1", "--kv-heads", "1", "--head-dim", "16", "--block-size", "4", "--device-blocks", "16",
         "--host-blocks", "8", "--quick", "--no-progress"]


def run_id() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def leftovers(rid: str) -> list[str]:
    return sorted(p.name for p in SHM.iterdir() if f"fkv.{rid}." in p.name)


def write_config(tmp_path: Path, **runner_options) -> Path:
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"heartbeat_s": 0.1, "dead_after_s": 1.0, "runner_options": runner_options}))
    return path


def start_cli(tmp_path: Path, rid: str, *extra: str, entries=ENTRIES, **runner_options) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "fastkv", "--out", str(tmp_path / "out"), "--run-id", rid,
           "--config", str(write_config(tmp_path, **runner_options)), *SMALL, *entries, *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def finish(proc: subprocess.Popen, timeout: float = 90) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        out, err = proc.communicate()
        raise AssertionError(f"supervisor did not finish in {timeout} s:\n{out}\n{err}") from None
    return proc.returncode, out, err


def wait_for(cond, what: str, timeout: float = 60.0, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"supervisor exited ({proc.returncode}) while waiting for {what}: "
                                 f"{proc.stderr.read() if proc.stderr else ''}")
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def attach_signals(rid: str, proc: subprocess.Popen) -> SignalArray:
    """The run's signal array, once every process of a tp=1 run is ready."""
    manifest = SHM / f"fkv.{rid}.manifest.json"
    wait_for(lambda: manifest.exists() and (SHM / f"fkv.{rid}.signals").exists(), "the run's signals", proc=proc)
    sig = wait_for(lambda: _try_attach(rid), "a complete signal array", proc=proc)
    wait_for(lambda: all(sig[f"{p}.ready"] for p in ("engine", "worker0", "transfer0")), "ready flags", proc=proc)
    return sig


def _try_attach(rid: str) -> SignalArray | None:
    try:
        return SignalArray.attach(Namespace.attach(rid), "signals")
    except ValueError:  # created but its magic not written yet
        return None


def test_run_completes_writes_report_and_leaves_nothing(tmp_path):
    rid = run_id()
    code, out, err = finish(start_cli(tmp_path, rid))
    assert code == 0, err
    o = tmp_path / "out"
    for name in ("workload.jsonl", "spec.json", "results.jsonl", "summary.json", "report.json", "report.png",
                 "logs/engine.log", "logs/worker0.log", "logs/transfer0.log"):
        assert (o / name).is_file(), f"{name} missing"
    requests = (o / "workload.jsonl").read_text().splitlines()
    assert len((o / "results.jsonl").read_text().splitlines()) == len(requests)
    assert json.loads(requests[0])["preemption"] == "offload"  # the CLI's default mode, written per request
    assert "throughput" in out and "report.png" in out
    # The ranks exit 0 when the engine closes its channels, before the engine exits: no failure, no restart.
    assert "restarted" not in err
    for rank_log in ("worker0.log", "transfer0.log"):
        assert "the engine closed its channel; exiting" in (o / "logs" / rank_log).read_text()
    assert json.loads((o / "spec.json").read_text())["storage_url"].startswith(f"lmdb://{o}/store")
    assert leftovers(rid) == []


def test_ranks_still_cleaning_up_when_the_engine_exits_are_left_to_finish(tmp_path):
    # Real ranks release their tiers and channels after the engine closed them; the supervisor's
    # shutdown must not take their cleared ready flag for "still starting" and SIGTERM them there
    # (Paddle's SIGTERM dump in every worker log, or a transfer process hung until SIGKILL).
    rid = run_id()
    code, out, err = finish(start_cli(tmp_path, rid, standin_cleanup_s=1.5, standin_linger_s=0.05))
    assert code == 0, err
    assert "killing" not in err and "restarted" not in err, err
    for rank_log in ("worker0.log", "transfer0.log"):
        assert "cleaned up" in (tmp_path / "out" / "logs" / rank_log).read_text(), rank_log
    assert leftovers(rid) == []


def test_sigterm_stops_cleanly(tmp_path):
    rid = run_id()
    proc = start_cli(tmp_path, rid, standin_request_s=1.0)
    sig = attach_signals(rid, proc)
    pids = [sig[f"{p}.pid"] for p in ("engine", "worker0", "transfer0")]
    sig.close()
    proc.send_signal(signal.SIGTERM)
    code, _, err = finish(proc, 60)
    assert code == 143, err
    assert "stopped by SIGTERM" in err
    assert not any(pid_alive(p) for p in pids)
    assert leftovers(rid) == []
    # The stand-in engine stops without a summary: the supervisor writes it, keeping the lines the
    # engine wrote and listing the other requests as unfinished.
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = [json.loads(line) for line in (tmp_path / "out" / "results.jsonl").read_text().splitlines()]
    assert len(rows) == len((tmp_path / "out" / "workload.jsonl").read_text().splitlines())
    assert summary["status"] == "stopped" and summary["states"]["unfinished"] >= 1
    assert summary["states"]["unfinished"] == sum(r.get("state") == "unfinished" for r in rows)


def _cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode().strip()


def test_each_process_shows_its_role_rank_and_run_id(tmp_path):
    rid = run_id()
    proc = start_cli(tmp_path, rid, standin_request_s=1.0)
    sig = attach_signals(rid, proc)
    try:
        titles = {p: _cmdline(sig[f"{p}.pid"]) for p in ("engine", "worker0", "transfer0")}
        titles["supervisor"] = _cmdline(proc.pid)
    finally:
        sig.close()
        proc.send_signal(signal.SIGTERM)
        finish(proc, 60)
    assert titles == {"engine": f"fastkv engine run {rid}", "worker0": f"fastkv worker[0] run {rid}",
                      "transfer0": f"fastkv transfer[0] run {rid}", "supervisor": f"fastkv supervisor run {rid}"}
    assert leftovers(rid) == []


@pytest.mark.parametrize("transfer", [
    "standin",
    pytest.param("real", marks=pytest.mark.skipif(importlib.util.find_spec("fastkv.transfer.process") is None,
                                                  reason="fastkv.transfer.process not merged yet")),
])
def test_sigkilled_transfer_is_restarted_and_run_completes(tmp_path, transfer):
    rid = run_id()
    entries = ENTRIES if transfer == "standin" else [e for e in ENTRIES if "=transfer=" not in e]
    proc = start_cli(tmp_path, rid, entries=entries, standin_wait_restart=True)
    sig = attach_signals(rid, proc)
    victim = sig["transfer0.pid"]
    assert sig["transfer0.gen"] == 0
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: sig["transfer0.gen"] == 1, "the gen bump", proc=proc)
    sig.close()
    code, _, err = finish(proc)
    assert code == 0, err
    assert "transfer0 killed by SIGKILL; restarted (gen 1)" in err
    assert not pid_alive(victim)
    assert leftovers(rid) == []


def test_hung_transfer_is_killed_and_restarted(tmp_path):
    rid = run_id()
    code, _, err = finish(start_cli(tmp_path, rid, standin_transfer_hang=True, standin_wait_restart=True))
    assert code == 0, err
    assert "transfer0 heartbeat silent for" in err and "restarted (gen 1)" in err
    assert leftovers(rid) == []


def test_dead_worker_fails_the_run_with_its_log(tmp_path):
    rid = run_id()
    code, _, err = finish(start_cli(tmp_path, rid, standin_worker_exit=3, standin_request_s=1.0))
    assert code == 1
    assert "run failed: worker0" in err and "exited with code 3" in err
    assert "exiting with 3 as asked" in err  # the tail of logs/worker0.log
    assert leftovers(rid) == []


def test_sigkilled_supervisor_takes_children_along_and_cleanup_removes_the_rest(tmp_path):
    rid = run_id()
    proc = start_cli(tmp_path, rid, standin_request_s=1.0)
    sig = attach_signals(rid, proc)
    pids = [sig[f"{p}.pid"] for p in ("engine", "worker0", "transfer0")]
    sig.close()
    proc.kill()
    proc.communicate()
    wait_for(lambda: not any(pid_alive(p) for p in pids), "children to die with the supervisor", timeout=15)
    left = leftovers(rid)
    assert f"fkv.{rid}.manifest.json" in left and f"fkv.{rid}.kvhost0" in left and f"fkv.{rid}.kvdev0" in left
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fastkv", "--cleanup"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"/fkv.{rid}.kvhost0" in done.stdout
    assert leftovers(rid) == []


def test_api_request_stop_and_bad_entry_point(tmp_path):
    cfg = JobConfig(layers=1, kv_heads=1, head_dim=16, block_size=4, device_blocks=16, host_blocks=0, quick=True,
                    preemption="recompute",
                    out=str(tmp_path / "out"), heartbeat_s=0.1, dead_after_s=1.0,
                    runner_options={"standin_request_s": 1.0})
    spec, workload = prepare(cfg, run_id())
    entries = {role: f"tests.e2e.standins:{role}_main" for role in ("engine", "worker", "transfer")}
    sup = Supervisor(spec, workload, entry_points=entries, progress=lambda f, t: None)

    def stop_when_ready():
        # every child up: one still starting is terminated at stop by design (exit -15)
        wait_for(lambda: sup.signals is not None and all(sup.signals[f"{n}.ready"] for n in
                                                         ("engine", "worker0", "transfer0")), "all ready")
        sup.request_stop("stopped by the test")

    t = threading.Thread(target=stop_when_ready)
    t.start()
    result = sup.run()
    t.join()
    assert not result.ok and result.message == "stopped by the test"
    assert result.exit_codes == {"transfer0": 0, "worker0": 0, "engine": 0}
    assert result.restarts == {"transfer0": 0}
    assert leftovers(spec.run_id) == []

    spec2, workload2 = prepare(dataclasses.replace(cfg, out=str(tmp_path / "out2")), run_id())
    bad = Supervisor(spec2, workload2, entry_points={**entries, "worker": "tests.e2e.no_such_module:main"}).run()
    assert not bad.ok and bad.message.startswith("worker0") and "No module named 'tests.e2e.no_such_module'" \
        in bad.message
    assert leftovers(spec2.run_id) == []
    with pytest.raises(ValueError, match="unknown roles"):
        Supervisor(spec2, workload2, entry_points={"scheduler": "x:y"})
    with pytest.raises(ValueError, match="does not exist"):
        Supervisor(spec2, tmp_path / "nope.jsonl")


def test_a_child_that_fails_to_start_is_reported_and_nothing_leaks(tmp_path, monkeypatch):
    """A Process.start() that raises (fork/spawn failure) leaves a child entry with no pid:
    shutdown must skip it (no sentinel, nothing to join), stop the others and unlink everything."""
    cfg = JobConfig(layers=1, kv_heads=1, head_dim=16, block_size=4, device_blocks=16, host_blocks=0, quick=True,
                    preemption="recompute", out=str(tmp_path / "out"), heartbeat_s=0.1, dead_after_s=1.0)
    spec, workload = prepare(cfg, run_id())
    entries = {role: f"tests.e2e.standins:{role}_main" for role in ("engine", "worker", "transfer")}
    sup = Supervisor(spec, workload, entry_points=entries, progress=lambda f, t: None)
    process_class = sup._ctx.Process
    real_start = process_class.start

    def start(self):
        if self.name == "fastkv-engine":
            raise OSError("simulated spawn failure")
        real_start(self)

    monkeypatch.setattr(process_class, "start", start)  # spawn pickles the process: patch its class
    with pytest.raises(OSError, match="simulated spawn failure"):
        sup.run()
    assert all(c.process.exitcode is not None for c in sup.children.values() if c.process.pid is not None)
    assert leftovers(spec.run_id) == []


def test_a_hybrid_offloads_per_group_and_cleanup_finds_each_groups_host_segment(tmp_path):
    """Real processes: a sliding-window hybrid under offload preemption completes with offloads in
    every group and leaves nothing; killed mid-run, ``--cleanup`` removes each group's host segment."""
    hybrid = ["--layers", "2", "--layer-windows", "8,0", "--preemption", "offload", "--device-blocks", "200",
              "--host-blocks", "400"]
    for sub in "ab":
        (tmp_path / sub).mkdir()
    rid = run_id()
    code, _, err = finish(start_cli(tmp_path / "a", rid, *hybrid, entries=()))
    assert code == 0, err
    assert "KV cache groups: " in err and " host)" in err, err
    summary = json.loads((tmp_path / "a" / "out" / "summary.json").read_text())
    assert summary["preemptions"]["offload"] > 0 and summary["verified"]["kv_mismatches"] == 0, summary
    assert all(g["offloaded_blocks"] > 0 for g in summary["kv_groups"]), summary["kv_groups"]
    assert leftovers(rid) == []
    rid = run_id()
    proc = start_cli(tmp_path / "b", rid, *hybrid, entries=ENTRIES, standin_request_s=1.0)
    attach_signals(rid, proc).close()
    proc.kill()
    proc.communicate()
    wait_for(lambda: f"fkv.{rid}.kvhost0g1" in leftovers(rid), "the run's host segments", timeout=15)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-m", "fastkv", "--cleanup"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert f"/fkv.{rid}.kvhost0g0" in done.stdout and f"/fkv.{rid}.kvhost0g1" in done.stdout
    wait_for(lambda: leftovers(rid) == [], "cleanup", timeout=15)

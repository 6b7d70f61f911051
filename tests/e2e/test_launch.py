"""fastkv.launch: one call sets up a run, watches its transfer processes, and leaves nothing behind;
and the embedding example (embed_example.py), run as written at tp 1 and tp 2."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from fastkv.config import KVLayout
from fastkv.launch import LaunchError, launch
from fastkv.run import READY, RunSpec

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]
LAYOUT = KVLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=8, dtype="float32")


def spec_for(tmp_path: Path, tp: int = 1, **kw) -> RunSpec:
    layout = KVLayout(LAYOUT.num_layers, LAYOUT.kv_heads, LAYOUT.block_size, LAYOUT.head_dim, LAYOUT.dtype, tp)
    return RunSpec(f"l{uuid.uuid4().hex[:10]}", layout, 16, 8, out_dir=str(tmp_path / "out"), heartbeat_s=0.1,
                   dead_after_s=2.0, **kw)


def leftovers(run_id: str) -> list[str]:
    return sorted(p.name for p in Path("/dev/shm").iterdir() if f"fkv.{run_id}." in p.name)


def dying_transfer(spec_json: str, rank: int) -> int:
    """Transfer stand-in: rank 1 says when, then SIGKILLs itself; the others run the real one."""
    if rank == 1:
        print(f"transfer1 stand-in: about to die at {time.monotonic():.6f}", flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    from fastkv.transfer.process import main

    return main(spec_json, rank)


def tier_making_worker(spec_json: str, rank: int) -> int:
    """The toy worker of a GPU deployment's ordering: it creates its rank's device tier itself."""
    from fastkv.engine.worker_api import WorkerPort
    from fastkv.transfer.tiers import DeviceTier
    from tests.e2e.embed_example import toy_step

    spec = RunSpec.from_json(spec_json)
    port = WorkerPort(spec, rank)
    tier = DeviceTier.create(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks, backend="shm")
    history: dict[str, list[int]] = {}
    port.ready()
    try:
        for plan in port.plans():
            port.answer(plan, *toy_step(plan, tier.k_arrays, tier.v_arrays, spec.layout.block_size, history))
    finally:
        tier.close()
        port.close()
    return 0


def test_workers_that_make_the_device_tiers_start_before_the_transfer_processes(tmp_path):
    from fastkv.engine import Engine
    from tests.e2e.embed_example import reference

    spec = spec_for(tmp_path, tp=2)
    with launch(spec, device_tiers="worker") as run:
        assert not run.children and not any("kvdev" in n for n in leftovers(spec.run_id))
        for rank in range(2):
            run.start("worker", rank, "tests.e2e.test_launch:tier_making_worker")
        run.wait_ready(["worker0", "worker1"])
        run.start_transfers()  # they attach the tiers the workers made
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready(60)
            prompts = [[5, 6, 7, 8, 9], [1, 2, 3]]
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, 6, request_id=f"q{i}", sampling={"seed": i})
            results = {r.id: r.output for r in engine.run()}
        finally:
            engine.close()
    assert results == {f"q{i}": reference(p, 6, i, 1.0) for i, p in enumerate(prompts)}
    assert leftovers(spec.run_id) == []


def test_launch_sets_up_a_run_and_removes_everything(tmp_path):
    spec = spec_for(tmp_path)
    with launch(spec) as run:
        assert run.signals["transfer0.ready"] == READY
        names = leftovers(spec.run_id)
        assert any("kvdev0" in n for n in names) and any("kvhost0" in n for n in names), names
        pid = run.children["transfer0"].process.pid
    assert leftovers(spec.run_id) == []
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_a_transfer_process_killed_during_launch_fails_it_within_2_s(tmp_path):
    spec = spec_for(tmp_path, tp=2)
    with pytest.raises(LaunchError) as err:
        with launch(spec, entry_points={"transfer": "tests.e2e.test_launch:dying_transfer"}):
            pytest.fail("launch went on with a dead transfer process")
    raised = time.monotonic()
    msg = str(err.value)
    assert "\n" not in msg and "transfer1 (rank 1" in msg and "killed by SIGKILL" in msg, msg
    died = float(re.search(r"about to die at ([0-9.]+)", msg).group(1))  # the log's last line, quoted
    assert raised - died < 2.0, f"{raised - died:.2f} s from the death to the error"
    assert leftovers(spec.run_id) == []


def test_a_dead_transfer_process_is_replaced_while_the_block_runs(tmp_path):
    spec = spec_for(tmp_path)
    with launch(spec) as run:
        first = run.children["transfer0"].process
        first.kill()
        deadline = time.monotonic() + 60
        while not (run.signals["transfer0.gen"] == 1 and run.signals["transfer0.ready"] == READY):
            assert time.monotonic() < deadline, "transfer0 not replaced within 60 s"
            time.sleep(0.05)
        assert run.children["transfer0"].process.pid != first.pid
        assert run.children["transfer0"].restarts == 1 and run.failure is None
    assert leftovers(spec.run_id) == []


def test_sigterm_unwinds_the_block_and_removes_everything(tmp_path):
    spec = spec_for(tmp_path)
    code = ("import sys, threading; from fastkv.run import RunSpec; from fastkv.launch import launch\n"
            "spec = RunSpec.from_json(sys.argv[1])\n"
            "with launch(spec) as run:\n"
            "    print('up', run.children['transfer0'].process.pid, flush=True)\n"
            "    threading.Event().wait(120)\n")
    proc = subprocess.Popen([sys.executable, "-c", code, spec.to_json()], stdout=subprocess.PIPE, text=True,
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    try:
        line = proc.stdout.readline()
        assert line.startswith("up"), line
        child = int(line.split()[1])
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) != 0
    finally:
        proc.kill()
    assert leftovers(spec.run_id) == []
    with pytest.raises(ProcessLookupError):
        os.kill(child, 0)


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_the_embedding_example_runs_as_written(tp):
    """Toy model worker on the documented API, launched by the one call: preemption happens,
    the outputs equal those of a run without it, every token streams in its own step."""
    proc = subprocess.run([sys.executable, str(ROOT / "tests/e2e/embed_example.py"), "--tp", str(tp)],
                          capture_output=True, text=True, timeout=170, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    assert report["tp"] == tp and report["preemptions"] > 0
    assert all(report["checks"].values()), report

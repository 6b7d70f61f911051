"""Start-time checks of the output directory, the run id and the nested config tables: one
line, rc 2, within 2 s, nothing started; two runs on one --out; never deleting what is not fastkv's."""
from __future__ import annotations

import json
import os

import pytest

from fastkv.cli import JobConfig, prepare
from fastkv.cli.outdir import LOCK, OutDir
from fastkv.ipc import Namespace
from tests.e2e.test_supervisor import SHM, attach_signals, finish, leftovers, run_id, start_cli
from tests.e2e.test_supervisor_cli import _cli_error

pytestmark = pytest.mark.timeout(180)


def one_line_error(tmp_path, *argv: str) -> str:
    rc, err, seconds = _cli_error(tmp_path, *argv)
    assert rc == 2 and seconds < 2.0, (rc, seconds, err)
    assert err.count("\n") == 1 and err.startswith("fastkv-supervisor: error: "), err
    assert not (tmp_path / "out" / "logs").exists()  # nothing was started
    return err.removeprefix("fastkv-supervisor: error: ").rstrip("\n")


def test_out_that_is_a_file_or_cannot_be_made(tmp_path):
    (tmp_path / "out").write_text("mine")
    assert one_line_error(tmp_path) == f"--out {tmp_path / 'out'} is not a directory"
    assert (tmp_path / "out").read_text() == "mine"
    under = tmp_path / "out" / "sub"
    assert one_line_error(tmp_path, "--out", str(under)) == f"--out {under} cannot be created: Not a directory"


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_unwritable_out(tmp_path):
    (tmp_path / "out").mkdir(mode=0o500)
    assert one_line_error(tmp_path) == f"--out {tmp_path / 'out'} is not writable: Permission denied"


def test_run_id_of_a_live_run(tmp_path):
    rid = run_id()
    ns = Namespace.create(rid)
    try:
        msg = one_line_error(tmp_path, "--run-id", rid)
    finally:
        ns.close()
    assert msg == f"--run-id {rid} is in use by a live run (pid {os.getpid()})"
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("table, message", [
    ({"scheduler": {"max_seqs": 4}}, "unknown scheduler settings ['max_seqs']; known: ["),
    ({"runner_options": {"verfy": "all"}}, "unknown runner_options ['verfy'] for the synthetic runner; known: "
                                           "['compute_us_per_token', 'copy_gbps', 'cost_model', "
                                           "'max_tracked_requests', 'step_us', 'verify', 'vocab', "
                                           "'weights_version']"),
    ({"runner": "tiny", "runner_options": {"config": {"hiden": 64}}}, "unknown runner_options.config settings "
                                                                      "['hiden']; known: ["),
])
def test_unknown_keys_in_nested_tables_name_the_file(tmp_path, table, message):
    path = tmp_path / "job.json"
    path.write_text(json.dumps(table))
    assert one_line_error(tmp_path, "--config", str(path)).startswith(f"config file {path}: {message}")


def test_a_shape_the_tiny_runner_cannot_run(tmp_path):
    assert one_line_error(tmp_path, "--runner", "tiny", "--head-dim", "15") == \
        "the tiny runner cannot run this shape: RoPE needs an even head_dim, got 15"


def test_a_store_fastkv_did_not_create_is_never_touched(tmp_path):
    thesis = tmp_path / "out" / "store" / "thesis.txt"
    thesis.parent.mkdir(parents=True)
    thesis.write_text("years of work")
    assert one_line_error(tmp_path) == (f"--out {tmp_path / 'out'}: {thesis.parent} was not created by fastkv; "
                                        "not touching it: give this run another --out or set --storage")
    assert thesis.read_text() == "years of work"


def test_files_fastkv_did_not_write_are_never_overwritten(tmp_path):
    mine = tmp_path / "out" / "summary.json"
    mine.parent.mkdir()
    mine.write_text("my summary")
    assert one_line_error(tmp_path) == (f"--out {tmp_path / 'out'} holds summary.json not written by fastkv "
                                        f"(no {LOCK}): give this run another --out")
    assert mine.read_text() == "my summary"


def test_a_previous_runs_files_and_store_are_cleared(tmp_path):
    cfg = JobConfig(quick=True, out=str(tmp_path / "out"))
    prepare(cfg, "first")
    out = tmp_path / "out"
    (out / "summary.json").write_text("{}")
    (out / "store" / "data.mdb").write_text("old")
    spec, _ = prepare(cfg, "second")
    assert spec.run_id == "second" and not (out / "summary.json").exists()
    assert sorted(p.name for p in (out / "store").iterdir()) == [".fastkv-store"]


def test_a_live_runs_out_is_refused(tmp_path):
    with OutDir.claim(tmp_path / "out", "holder1"):
        msg = one_line_error(tmp_path)
    assert msg == f"--out {tmp_path / 'out'} is in use by run holder1 (pid {os.getpid()}): give this run another --out"


def test_two_supervisors_on_one_out(tmp_path):
    """The second is refused at once; the first finishes with its own results."""
    first, second = run_id(), run_id()
    proc = start_cli(tmp_path, first, standin_request_s=0.1)
    attach_signals(first, proc).close()
    clash = start_cli(tmp_path, second)
    code, _, err = finish(clash, 30)
    assert code == 2 and err.count("\n") == 1, err
    assert f"is in use by run {first} (pid {proc.pid})" in err
    assert not (SHM / f"fkv.{second}.manifest.json").exists()
    code, _, err = finish(proc)
    assert code == 0, err
    out = tmp_path / "out"
    assert json.loads((out / "spec.json").read_text())["run_id"] == first
    requests = [json.loads(line)["id"] for line in (out / "workload.jsonl").read_text().splitlines()]
    assert [json.loads(line)["id"] for line in (out / "results.jsonl").read_text().splitlines()] == requests
    assert leftovers(first) == [] and leftovers(second) == []


def test_a_dead_runs_lock_is_taken_over(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"run_id": "deadrun", "pid": 2**22 + 1}))  # above pid_max: never alive
    (out / "summary.json").write_text("{}")  # that run's
    rid = run_id()
    code, _, err = finish(start_cli(tmp_path, rid))
    assert code == 0, err
    assert json.loads((out / LOCK).read_text())["run_id"] == rid
    assert json.loads((out / "summary.json").read_text())["requests"] > 0  # this run's, not the dead one's
    assert leftovers(rid) == []

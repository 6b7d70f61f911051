"""fastkv-supervisor settings: defaults < config file (TOML/JSON) < flags, clear errors for bad values."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fastkv.cli import AUTO_DEVICE_BYTES, JobConfig, _flags, build_parser, main, prepare, read_config_file
from fastkv.run import RunSpec

ROOT = Path(__file__).resolve().parents[2]


def flags(*argv: str) -> dict:
    return _flags(build_parser().parse_args(list(argv)))  # what main() hands JobConfig


def test_defaults_are_the_main_job(tmp_path):
    cfg = JobConfig()
    assert (cfg.tp, cfg.runner, cfg.preemption, cfg.workload, cfg.storage) == (1, "synthetic", "offload", "demo",
                                                                              "default")
    spec = cfg.to_spec("abc123", tmp_path)
    assert spec.storage_url == f"lmdb://{tmp_path}/store?max_bytes=1G"
    assert spec.runner_options == {"compute_us_per_token": 300.0, "verify": "resumed"}
    assert spec.cache_policy == "write_through"
    assert RunSpec.from_json(spec.to_json()) == spec
    # Memory pressure: each wave of turns needs more blocks than the device tier has, the last far more.
    for quick in (False, True):
        c = JobConfig(quick=quick)
        requests, turns = c.requests(), c.demo_config().turns
        wave = [sum(-(-(len(r["prompt"]) + r["max_new_tokens"]) // c.block_size) for r in requests
                    if r["id"].endswith(f"t{t}")) for t in range(turns)]
        assert min(wave) > c.device_blocks and wave[-1] > 1.8 * c.device_blocks, wave


def test_a_trace_runs_own_workload_file_gets_the_traces_device_tier(tmp_path):
    """The restart pair on a trace: run B replays run A's workload.jsonl on A's store. Before,
    a file got the demo's 64 blocks and B rejected 15 of 64 requests that A had run."""
    trace = JobConfig(workload="trace:64")
    wl = tmp_path / "workload.jsonl"
    wl.write_text("".join(json.dumps(r) + "\n" for r in trace.requests()))
    again = JobConfig(workload=str(wl))
    longest = max(len(r["prompt"]) + r["max_new_tokens"] for r in trace.requests())
    assert again.device_blocks == trace.device_blocks >= -(-longest // trace.block_size) > 64
    assert JobConfig(device_blocks=32, workload=str(wl)).device_blocks == 32  # given: kept
    assert JobConfig().device_blocks == 64  # the demo keeps its small tier
    huge = tmp_path / "huge.jsonl"  # sized by its longest request only up to AUTO_DEVICE_BYTES
    huge.write_text(json.dumps({"id": "h", "arrival_s": 0, "prompt": [1] * 2_000_000, "max_new_tokens": 4}) + "\n")
    capped = JobConfig(workload=str(huge))
    assert capped.device_blocks * capped.layout().block_bytes == AUTO_DEVICE_BYTES


def test_toml_then_flags(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('tp = 2\nblock_size = 8\npreemption = "recompute"\nstorage = "none"\n'
                    '[runner_options]\nverify = "all"\n[demo]\nconversations = 3\nuser_tokens = [4, 8]\n')
    cfg = JobConfig.from_sources(path, flags("--tp", "1", "--device-blocks", "64"))
    assert (cfg.tp, cfg.block_size, cfg.device_blocks, cfg.preemption) == (1, 8, 64, "recompute")
    spec = cfg.to_spec("r1", tmp_path)
    assert spec.storage_url == "" and spec.layout.block_size == 8 and spec.num_device_blocks == 64
    assert spec.runner_options == {"compute_us_per_token": 300.0, "verify": "all"}
    demo = cfg.demo_config()
    assert demo.conversations == 3 and demo.user_tokens == (4, 8)


def test_no_host_tier_means_no_default_storage(tmp_path):
    spec = JobConfig(host_blocks=0, preemption="recompute").to_spec("r2", tmp_path)
    assert spec.num_host_blocks == 0 and spec.storage_url == ""


def test_json_config_and_quick(tmp_path):
    path = tmp_path / "job.json"
    path.write_text(json.dumps({"runner": "tiny", "quick": True, "workload": "trace:5"}))
    cfg = JobConfig.from_sources(path, flags())
    assert cfg.runner == "tiny" and cfg.quick and len(cfg.requests()) == 5
    assert len(JobConfig(quick=True).requests()) < len(JobConfig().requests())


@pytest.mark.parametrize("values, message", [
    ({"cache_policy": "lru"}, "'cache_policy' must be one of"),
    ({"tp": 0}, "'tp' must be >= 1"),
    ({"tp": "2"}, "'tp' must be of type int"),
    ({"device_blocks": True}, "'device_blocks' must be of type int"),
    ({"host_blocks": -1}, "'host_blocks' must be >= 0"),
    ({"preemption": "swap"}, "'preemption' must be one of"),
    ({"runner": "llama"}, "'runner' must be one of"),
    ({"storage": "s3://bucket"}, "'storage' must be 'default', 'none' or a URL"),
    ({"storage": "none", "preemption": "storage"}, "needs a storage tier"),
    ({"storage": "none", "storage_write": "back"}, "storage_write 'back' says what reaches a storage tier"),
    ({"host_blocks": 0, "preemption": "recompute", "storage_write": "preempted"}, "this run has none"),
    ({"host_blocks": 0}, "preemption 'offload' needs a host tier"),
    ({"host_blocks": 0, "preemption": "storage"}, "preemption 'storage' needs a host tier"),
    ({"host_blocks": 0, "preemption": "recompute", "storage": "lmdb:///tmp/x"}, "storage tier needs a host tier"),
    ({"runner": "tiny", "dtype": "bfloat16"}, "tiny runner needs KV dtype 'float32'"),
    ({"head_dim": 8}, "synthetic runner needs head_dim > 8"),
    ({"dtype": "float64"}, "KVLayout.dtype must be one of"),
    ({"metrics_port": 70000}, "'metrics_port' must be in"),
    ({"heartbeat_s": 1.0, "dead_after_s": 0.5}, "dead_after_s > heartbeat_s"),
    ({"workload": "trace:zero"}, "positive request count"),
    ({"demo": {"turns": 0}}, "ConversationConfig.turns"),
    ({"demo": {"speed": 1}}, "unknown demo settings"),
    ({"storage_backlog_blocks": -1}, "'storage_backlog_blocks' must be >= 0"),
    ({"storage_backlog_blocks": "many"}, "'storage_backlog_blocks' must be of type int"),
    ({"hit_policy": "sometimes"}, "'hit_policy' must be one of"),
    ({"prefetch_policy": "eager"}, "'prefetch_policy' must be one of"),
    ({"prefetch_timeout_per_1k_tokens_s": -1.0}, "'prefetch_timeout_per_1k_tokens_s' must be >= 0"),
])
def test_bad_values_are_named(values, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        JobConfig(**values)


def test_bad_config_files(tmp_path):
    with pytest.raises(ValueError, match="not found"):
        read_config_file(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("tp = \n")
    with pytest.raises(ValueError, match="bad.toml"):
        read_config_file(bad)
    typo = tmp_path / "typo.json"
    typo.write_text(json.dumps({"tp_size": 2}))
    with pytest.raises(ValueError, match=r"unknown settings \['tp_size'\]"):
        read_config_file(typo)
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(ValueError, match="must hold a table"):
        read_config_file(listed)


def test_cli_reports_bad_values_as_usage_errors(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--tp", "0", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "--tp must be >= 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--entry", "scheduler=x:y", "--out", str(tmp_path)])
    assert "--entry must be ROLE=MODULE:FUNC" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--workload", str(tmp_path / "none.jsonl"), "--out", str(tmp_path)])
    assert "not found" in capsys.readouterr().err


def test_a_c_extension_not_built_is_one_line_saying_how_to_build_it(tmp_path, capsys, monkeypatch):
    """As after a git pull that added an extension, without pip install -e . again."""
    from fastkv.native.compiled import NotBuilt, load

    with pytest.raises(NotBuilt, match="_no_such_ext is not built .*pip install -e ."):
        load("_no_such_ext")

    def runner_module_missing(self):
        load("_no_such_ext")

    monkeypatch.setattr(JobConfig, "check_runner_options", runner_module_missing)
    with pytest.raises(SystemExit) as exc:
        main(["--quick", "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and len(err.strip().splitlines()) == 1
    assert "C extension _no_such_ext is not built" in err and "build_ext --inplace" in err
    assert not (tmp_path / "out").exists()  # refused before anything was written


def test_a_misspelt_flag_is_an_error_not_another_flag(tmp_path, capsys):
    """argparse would take --storag for --storage; a typo must be named, not guessed."""
    with pytest.raises(SystemExit) as exc:
        main(["--storag", "none", "--out", str(tmp_path)])
    assert exc.value.code == 2 and "unrecognized arguments: --storag none" in capsys.readouterr().err


def test_prepare_writes_workload_with_mode_and_spec(tmp_path):
    wl = tmp_path / "mine.jsonl"
    wl.write_text(json.dumps({"id": "a", "arrival_s": 0, "prompt": [1, 2, 3], "max_new_tokens": 2}) + "\n")
    cfg = JobConfig(workload=str(wl), preemption="storage", out=str(tmp_path / "o"))
    prepare(cfg, "rid0")  # a previous run: its summary and store are cleared
    (tmp_path / "o" / "summary.json").write_text("{}")
    spec, path = prepare(cfg, "rid1")
    assert json.loads(path.read_text()) == {"id": "a", "arrival_s": 0, "prompt": [1, 2, 3], "max_new_tokens": 2,
                                            "preemption": "storage"}
    assert RunSpec.load(tmp_path / "o" / "spec.json") == spec and spec.run_id == "rid1"
    assert not (tmp_path / "o" / "summary.json").exists()
    assert [p.name for p in (tmp_path / "o" / "store").iterdir()] == [".fastkv-store"]


def test_console_help_runs():
    done = subprocess.run([sys.executable, "-m", "fastkv", "--help"], cwd=ROOT, capture_output=True, text=True,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"}, timeout=60)
    assert done.returncode == 0 and "--preemption" in done.stdout and "--cleanup" in done.stdout


def _cli_error(tmp_path, *argv: str) -> tuple[int, str, float]:
    """rc, stderr and seconds of an in-process run that must stop before starting anything."""
    import contextlib
    import io
    import time

    err = io.StringIO()
    t0 = time.monotonic()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as exc:
        main(["--out", str(tmp_path / "out"), "--no-progress", *argv])
    return exc.value.code, err.getvalue(), time.monotonic() - t0


@pytest.mark.parametrize("make_url, message", [
    (lambda d: f"lmdb://{d / 'a-file'}", "storage tier 'lmdb://{d}/a-file' cannot be used: lmdb store path "
                                         "'{d}/a-file' is not a directory"),
    (lambda d: f"lmdb://{d}/s?max_bytes=lots", "bad value for 'max_bytes' in storage URL 'lmdb://{d}/s?max_bytes=lots'"),
    (lambda d: f"lmdb://{d}/s?writemap=1", "option 'writemap' in storage URL 'lmdb://{d}/s?writemap=1' is not "
                                           "supported: with it a full disk crashes the transfer process (SIGBUS)"),
    (lambda d: "redis://127.0.0.1:1", "storage tier 'redis://127.0.0.1:1' cannot be used: ConnectionError"),
])
def test_an_unusable_storage_tier_stops_the_run_before_it_starts(tmp_path, make_url, message):
    (tmp_path / "a-file").write_text("not a directory")
    rc, err, seconds = _cli_error(tmp_path, "--preemption", "storage", "--storage", make_url(tmp_path))
    assert rc == 2 and seconds < 2.0, (rc, seconds)
    assert err.count("\n") == 1 and err.startswith("fastkv-supervisor: error: "), err
    assert message.format(d=tmp_path) in err
    assert not (tmp_path / "out" / "logs").exists()  # no process was started


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory")
def test_a_read_only_lmdb_directory_stops_the_run(tmp_path):
    store = tmp_path / "ro"
    store.mkdir(mode=0o500)
    rc, err, _ = _cli_error(tmp_path, "--preemption", "storage", "--storage", f"lmdb://{store}")
    assert rc == 2 and f"storage tier 'lmdb://{store}' cannot be used" in err and err.count("\n") == 1


def test_fastdeploy_names_map_onto_fastkvs_settings(tmp_path):
    """swap_space (GiB) / num_cpu_blocks -> host_blocks, kvcache_storage_backend -> storage; in files and flags."""
    path = tmp_path / "fd.toml"
    path.write_text('swap_space = 0.5\nkvcache_storage_backend = "redis://127.0.0.1:6379"\nblock_size = 32\n'
                    'enable_prefix_caching = false\n')
    cfg = JobConfig.from_sources(path)
    block = cfg.layout().block_bytes
    assert cfg.block_size == 32 and cfg.host_blocks == 2**29 // block
    spec = cfg.to_spec("fd", tmp_path)
    assert spec.num_host_blocks == 2**29 // block and spec.storage_url == "redis://127.0.0.1:6379"
    assert spec.enable_prefix_caching is False
    cfg = JobConfig.from_sources(None, flags("--num-cpu-blocks", "77", "--weights-version", "rl-3",
                                             "--update-weights-at", "8:v2", "--update-weights-at", "20:v3",
                                             "--free-memory-on-update", "--no-enable-prefix-caching",
                                             "--tp", "2", "--device-ids", "1,0"))
    spec = cfg.to_spec("fd2", tmp_path)
    assert spec.num_host_blocks == 77 and spec.weights_version == "rl-3" and spec.free_memory_on_update
    assert spec.weight_updates() == [(8, "v2"), (20, "v3")] and not spec.enable_prefix_caching
    assert [spec.device_id(r) for r in range(2)] == [1, 0]
    assert [JobConfig(tp=2).to_spec("d", tmp_path).device_id(r) for r in range(2)] == [0, 1]


@pytest.mark.parametrize(("values", "message"), [
    ({"swap_space": 1.0, "num_cpu_blocks": 4}, "not both"),
    ({"storage": "none", "kvcache_storage_backend": "lmdb:///tmp/x"}, "not both"),
    ({"swap_space": -1.0}, "must be >= 0"),
    ({"update_weights_at": "8"}, "expected N:VERSION"),
    ({"update_weights_at": "8:v2,4:v3"}, "comes after 8 finished"),
    ({"update_weights_at": "8:0"}, "other than the one before"),
    ({"tp": 2, "device_ids": "0"}, "device_ids must name 2 distinct devices"),
    ({"device_ids": "gpu0"}, "comma-separated device numbers"),
])
def test_bad_control_settings_are_named(values, message):
    with pytest.raises(ValueError, match=message):
        JobConfig(**values)


def test_role_settings_are_named(tmp_path):
    store = f"lmdb://{tmp_path}/s"
    with pytest.raises(ValueError, match="hands KV over through a shared store"):
        JobConfig(role="decode", handoff=str(tmp_path / "h.jsonl"))
    with pytest.raises(ValueError, match="needs --handoff FILE"):
        JobConfig(role="decode", storage=store)
    with pytest.raises(ValueError, match="'handoff' is for --role decode"):
        JobConfig(handoff=str(tmp_path / "h.jsonl"))
    JobConfig(role="decode", storage=store, handoff=str(tmp_path / "later" / "h.jsonl"))  # may appear later


def test_a_handoff_file_that_is_no_handoff_stream_is_refused_by_name(tmp_path, capsys):
    other = tmp_path / "results.jsonl"
    other.write_text('{"id": "a", "output": []}\n')
    with pytest.raises(SystemExit) as exc:
        main(["--role", "decode", "--storage", f"lmdb://{tmp_path}/s", "--handoff", str(other),
              "--out", str(tmp_path / "o")])
    assert exc.value.code == 2
    assert f"--handoff {other}:1: not a prefill run's handoff.jsonl" in capsys.readouterr().err
    header = tmp_path / "handoff.jsonl"
    header.write_text('{"header": {"pid": 1, "started": 0}}\n')
    JobConfig(role="decode", storage=f"lmdb://{tmp_path}/s", handoff=str(header))


def test_a_host_tier_too_big_for_memory_fails_the_run_in_one_line_naming_the_flag(tmp_path, capsys):
    blocks = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize // (64 << 10) + 16
    rc = main(["--out", str(tmp_path / "out"), "--no-progress", "--host-blocks", str(blocks)])
    err = capsys.readouterr().err
    failed = [line for line in err.splitlines() if "run failed" in line]
    assert rc == 1 and len(failed) == 1, err
    assert f"the host tier of rank 0 (--host-blocks {blocks} x 64 KiB) does not fit" in failed[0]
    assert "Traceback" not in err
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert summary["status"].startswith("failed: the host tier") and summary["generated_tokens"] == 0


@pytest.mark.slow
def test_a_storage_tier_that_falls_behind_is_said_at_the_end(tmp_path):
    """With no room for optional STOREs every one the write policy wants is skipped: the summary
    counts them and the run ends with one warning naming the setting (it used to say nothing)."""
    out = tmp_path / "out"
    done = subprocess.run([sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(out),
                           "--storage-backlog-blocks", "0"], cwd=ROOT, capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["storage_blocks_skipped"] > 0 and summary["storage_blocks_stored"] == 0, summary
    by = summary["storage_blocks_skipped_by"]
    assert by["tail"] + by["shared"] == summary["storage_blocks_skipped"] and by["shared"] > 0, by
    warned = [line for line in done.stderr.splitlines() if "fell behind" in line]
    assert len(warned) == 1 and "--storage-backlog-blocks 0" in warned[0], done.stderr[-2000:]
    assert f"{summary['storage_blocks_skipped']} of the {summary['storage_blocks_skipped']} blocks" in warned[0]
    assert f"{by['tail']} unshared tails and {by['shared']} shared" in warned[0], warned[0]

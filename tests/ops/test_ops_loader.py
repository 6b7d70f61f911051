"""Loading the ops: lazy Paddle import, one build under concurrency, prebuilt-library selection,
and a killed build leaving no compiler and no scratch directory."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastkv.kernels import ops
from tests.e2e.test_supervisor import wait_for
from tests.optional import require_paddle
from tests.procs import processes_mentioning

ROOT = Path(__file__).resolve().parents[2]


def test_fastkv_imports_without_paddle_and_says_what_to_install():
    code = (
        "import sys; sys.modules['paddle'] = None\n"  # makes `import paddle` raise ImportError
        "import fastkv, fastkv.kernels.ops, fastkv.transfer.tiers, fastkv.kernels.cuda_abi\n"
        "try:\n"
        "    fastkv.kernels.ops.swap_blocks([], [], None, [], [], to_host=True)\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "fastkv[cpu]" in result.stdout and "paddlepaddle-gpu" in result.stdout


def test_concurrent_builds_compile_once(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTKV_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "build_tag", lambda: "tag1")
    calls = []

    def fake_compile(root: Path, tag: str, verbose: bool) -> None:
        calls.append(tag)
        time.sleep(0.2)  # a wide window for a second builder to slip in, were the lock missing
        (root / f"{ops.LIB_NAME}.so").write_bytes(b"lib")
        (root / "TAG").write_text(tag + "\n")

    monkeypatch.setattr(ops, "_compile", fake_compile)
    results = []
    threads = [threading.Thread(target=lambda: results.append(ops.build())) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert calls == ["tag1"], f"compiled {len(calls)} times"
    assert results == [tmp_path / "tag1" / f"{ops.LIB_NAME}.so"] * 4


def test_a_build_sweeps_the_scratch_dirs_of_dead_builders(tmp_path, monkeypatch):
    monkeypatch.setenv("FASTKV_OPS_CACHE", str(tmp_path))
    monkeypatch.setattr(ops, "build_tag", lambda: "tag1")
    dead_pid = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, check=True).stdout.strip()
    dead, live = tmp_path / "tag1" / f".build-{dead_pid}", tmp_path / "tag1" / f".build-{os.getppid()}"
    (dead / "fastkv_ops").mkdir(parents=True)
    live.mkdir()

    def fake_compile(root: Path, tag: str, verbose: bool) -> None:
        (root / f"{ops.LIB_NAME}.so").write_bytes(b"lib")
        (root / "TAG").write_text(tag + "\n")

    monkeypatch.setattr(ops, "_compile", fake_compile)
    ops.build()
    assert not dead.exists(), "the scratch dir of a SIGKILLed build was left"
    assert live.exists(), "the scratch dir of a build still running was removed"


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=lambda s: s.name)
def test_a_killed_build_leaves_no_compiler_and_no_scratch_dir(tmp_path, sig):
    require_paddle()
    env = {**os.environ, "FASTKV_OPS_CACHE": str(tmp_path), "PYTHONPATH": str(ROOT)}
    builder = subprocess.Popen([sys.executable, "-m", "fastkv.kernels.ops", "build"], env=env,
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: any("cc1plus" in p for p in processes_mentioning(str(tmp_path))), "the compiler",
                 timeout=300, proc=builder)
        builder.send_signal(sig)
        builder.wait(30)
        # SIGKILL: the build's watchdog notices its parent died and cleans up after it
        wait_for(lambda: not processes_mentioning(str(tmp_path)), "every build process to end", timeout=30)
    finally:
        if builder.poll() is None:
            builder.kill()
            builder.wait()
    assert not list(tmp_path.glob("*/.build-*")), "a killed build left its scratch dir"


def test_prebuilt_library_is_used_only_when_its_tag_matches(tmp_path, monkeypatch):
    monkeypatch.setattr(ops, "PREBUILT_DIR", tmp_path)
    assert ops._prebuilt_library("abc") is None
    (tmp_path / f"{ops.LIB_NAME}.so").write_bytes(b"lib")
    (tmp_path / "TAG").write_text("abc\n")
    assert ops._prebuilt_library("abc") == tmp_path / f"{ops.LIB_NAME}.so"
    assert ops._prebuilt_library("other") is None, "a stale prebuilt library was chosen over a rebuild"
    assert ops._prebuilt_library(None) == tmp_path / f"{ops.LIB_NAME}.so", "without sources the prebuilt is all"


def test_build_tag_follows_the_sources(paddle_ops, tmp_path, monkeypatch):
    tag = ops.build_tag()
    assert tag == ops.build_tag()
    for path in ops._source_files(ops._with_cuda()):
        name = path.relative_to(ops.OPS_DIR)
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(path.read_bytes())
    monkeypatch.setattr(ops, "OPS_DIR", tmp_path)
    assert ops.build_tag() == tag
    (tmp_path / "swap_common.h").write_bytes(b"// changed\n" + (tmp_path / "swap_common.h").read_bytes())
    assert ops.build_tag() != tag


def test_cli_where_prints_the_loaded_library(paddle_ops):
    result = subprocess.run([sys.executable, "-m", "fastkv.kernels.ops", "where"], cwd=ROOT, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"{ops.LIB_NAME}.so")


@pytest.mark.parametrize("value", [[1.5], ["a"]])
def test_ids_must_be_integers(paddle_ops, value):
    with pytest.raises(TypeError, match="integers"):
        ops._ids(value, "src")


def test_a_child_that_took_back_paddles_signal_handlers_dies_at_once_on_sigterm():
    # Paddle's C++ handler answers SIGTERM with a stack dump ("FatalError: `Termination signal`"):
    # in every worker's log after a clean run, and once a transfer process hung in it until SIGKILL.
    # SIGINT stays ignored, as the supervisor's children set it: Ctrl-C is the supervisor's to handle.
    code = ("import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); from fastkv.kernels import ops; "
            "ops.default_fatal_signals(); os.kill(os.getpid(), signal.SIGINT); "
            "print('armed', flush=True); os.kill(os.getpid(), signal.SIGTERM); sys.stdin.read()")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                          capture_output=True, text=True, timeout=120, stdin=subprocess.PIPE)
    assert proc.stdout == "armed\n", proc.stderr
    assert proc.returncode == -signal.SIGTERM, (proc.returncode, proc.stderr)
    assert "Termination signal" not in proc.stderr and "FatalError" not in proc.stderr, proc.stderr

"""Loading the ops: lazy Paddle import, one build under concurrency, prebuilt-library selection."""
from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fastkv import ops

ROOT = Path(__file__).resolve().parents[2]


def test_fastkv_imports_without_paddle_and_says_what_to_install():
    code = (
        "import sys; sys.modules['paddle'] = None\n"  # makes `import paddle` raise ImportError
        "import fastkv, fastkv.ops, fastkv.transfer.tiers, fastkv.cuda_abi\n"
        "try:\n"
        "    fastkv.ops.swap_blocks([], [], None, [], [], to_host=True)\n"
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
    for name in ("swap_op.cc", "swap_common.h", "swap_cuda.h"):
        (tmp_path / name).write_bytes((ops.OPS_DIR / name).read_bytes())
    monkeypatch.setattr(ops, "OPS_DIR", tmp_path)
    assert ops.build_tag() == tag
    (tmp_path / "swap_common.h").write_bytes(b"// changed\n" + (tmp_path / "swap_common.h").read_bytes())
    assert ops.build_tag() != tag


def test_cli_where_prints_the_loaded_library(paddle_ops):
    result = subprocess.run([sys.executable, "-m", "fastkv.ops", "where"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().endswith(f"{ops.LIB_NAME}.so")


@pytest.mark.parametrize("value", [[1.5], ["a"]])
def test_ids_must_be_integers(paddle_ops, value):
    with pytest.raises(TypeError, match="integers"):
        ops._ids(value, "src")

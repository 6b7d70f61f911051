"""The GPU architectures the CUDA code is built for: FASTKV_CUDA_ARCH's syntax, and the -gencode flags
reaching nvcc's command line in Paddle's JIT build of the op (a stand-in nvcc records it)."""
from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from fastkv.kernels import cuda_abi, cuda_arch, ops
from tests.optional import require_paddle

ROOT = Path(__file__).resolve().parents[2]
DEFAULT = ("-gencode=arch=compute_80,code=sm_80", "-gencode=arch=compute_90,code=sm_90",
           "-gencode=arch=compute_90,code=compute_90")


def test_default_is_sm80_sm90_and_ptx(monkeypatch):
    monkeypatch.delenv(cuda_arch.ENV, raising=False)
    assert cuda_arch.gencode_flags() == DEFAULT
    assert cuda_abi.DEFAULT_ARCH_FLAGS == DEFAULT


@pytest.mark.parametrize("spec,want", [
    ("86", ("-gencode=arch=compute_86,code=sm_86",)),
    ("8.0; 9.0+PTX", DEFAULT),
    ("80,90+ptx,80", DEFAULT),
    ("100 90a+PTX", ("-gencode=arch=compute_100,code=sm_100", "-gencode=arch=compute_90a,code=sm_90a",
                     "-gencode=arch=compute_90a,code=compute_90a")),
])
def test_env_overrides_the_list(monkeypatch, spec, want):
    monkeypatch.setenv(cuda_arch.ENV, spec)
    assert cuda_arch.gencode_flags() == want


@pytest.mark.parametrize("spec", ["sm_90", "9", "1000", "80+SASS", ",;"])
def test_a_bad_list_is_one_line_naming_the_variable(monkeypatch, spec):
    monkeypatch.setenv(cuda_arch.ENV, spec)
    with pytest.raises(ValueError, match=f"^{cuda_arch.ENV}=") as info:
        cuda_arch.gencode_flags()
    assert "\n" not in str(info.value)


def test_the_arch_list_is_part_of_a_cuda_builds_tag_only(monkeypatch):
    require_paddle()
    monkeypatch.delenv(cuda_arch.ENV, raising=False)
    for with_cuda in (False, True):
        monkeypatch.setattr(ops, "_with_cuda", lambda with_cuda=with_cuda: with_cuda)
        default = ops.build_tag()
        monkeypatch.setenv(cuda_arch.ENV, "86")
        changed = ops.build_tag()
        monkeypatch.delenv(cuda_arch.ENV)
        # A CUDA build for other GPUs is another build; a CPU build does not depend on the list.
        assert (default != changed) == with_cuda


FAKE_NVCC = """#!/bin/sh
printf '%s\\n' "$@" >> "$FAKE_NVCC_ARGS"
echo "stand-in nvcc: not compiling" >&2
exit 1
"""


@pytest.mark.parametrize("spec", [None, "86"], ids=["default", "FASTKV_CUDA_ARCH=86"])
def test_the_gencode_flags_reach_nvcc_in_paddles_jit_build(tmp_path, spec):
    """Paddle's JIT build of the op with its CUDA source (as on a GPU machine), under a CUDA home
    whose nvcc records its arguments and fails: the build fails, and nvcc was given the flags."""
    require_paddle()
    cuda_home = tmp_path / "cuda"
    (cuda_home / "bin").mkdir(parents=True)
    (cuda_home / "include").mkdir()
    nvcc = cuda_home / "bin" / "nvcc"
    nvcc.write_text(FAKE_NVCC)
    nvcc.chmod(nvcc.stat().st_mode | stat.S_IXUSR)
    args_file = tmp_path / "nvcc-args"
    env = {**os.environ, "CUDA_HOME": str(cuda_home), "FAKE_NVCC_ARGS": str(args_file), "PYTHONPATH": str(ROOT)}
    env.pop(cuda_arch.ENV, None)
    if spec is not None:
        env[cuda_arch.ENV] = spec
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    result = subprocess.run([sys.executable, "-m", "fastkv.kernels.ops", "_compile-into", str(scratch), "--cuda"],
                            cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode != 0, "the stand-in nvcc compiles nothing: the build must fail"
    args = args_file.read_text().split("\n")
    assert any(a.endswith("swap_cuda.cu") for a in args), args
    want = DEFAULT if spec is None else ("-gencode=arch=compute_86,code=sm_86",)
    for flag in want:
        assert flag in args, f"nvcc was not given {flag}: {args}"
    assert not [a for a in args if a.startswith("-gencode") and a not in want], args

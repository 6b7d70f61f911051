"""Compile checks of the Paddle op's GPU variant on a machine with neither a GPU nor a CUDA build
of Paddle: ``python -m fastkv.kernels.gpu_build --out DIR`` (scripts/check_gpu_build.sh runs it, and CI
runs that). Needs $CUDA_HOME with bin/nvcc, CUDA's headers (the math libraries' and cuDNN's too:
Paddle's GPU headers include them) and lib64/libcudart.so.

1. ``strict``: the op's C++ source (the others include no Paddle or CUDA header) with the GPU
   build's defines (PADDLE_WITH_CUDA, FASTKV_WITH_CUDA), syntax only, under -Wall -Wextra
   -Werror; Paddle's and CUDA's headers are system headers, so only fastkv's code is held to it.
   Paddle's JIT passes -w to every compile, so no warning could fail step 2. (swap_cuda.cu's
   warnings fail ``python -m fastkv.kernels.cuda_abi --werror``: the same file, the same nvcc.)
2. ``op``: Paddle's JIT build of the ops with swap_cuda.cu, exactly as on a GPU machine; its
   nvcc command for swap_cuda.cu must carry every -gencode flag of ``fastkv.kernels.cuda_arch``.
"""
from __future__ import annotations

import argparse
import os
import shlex
import subprocess
import sys
import sysconfig
import time
import warnings
from pathlib import Path

from fastkv.kernels import cuda_arch, ops

_CUDA_SOURCE = "swap_cuda.cu"
_OP_SOURCE = "swap_op.cc"
# What Paddle's JIT adds to a .cc compiled beside a .cu (paddle/utils/cpp_extension), and fastkv's own.
_GPU_CXX_DEFINES = ("-DPADDLE_WITH_CUDA", "-DPADDLE_WITH_CUSTOM_KERNEL", f"-DPADDLE_EXTENSION_NAME={ops.LIB_NAME}",
                    "-D_GLIBCXX_USE_CXX11_ABI=1", "-DFASTKV_WITH_CUDA")
STRICT_FLAGS = ("-Wall", "-Wextra", "-Werror")


class BuildCheckError(RuntimeError):
    pass


def _paddle_include_dirs() -> list[str]:
    """The include directories Paddle's JIT gives a CUDA build ($CUDA_HOME's included)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "No ccache found"
        from paddle.utils.cpp_extension.extension_utils import find_paddle_includes

        return [*find_paddle_includes(use_cuda=True), sysconfig.get_paths()["include"]]


def strict_command(source: Path) -> list[str]:
    cxx = os.environ.get("CXX", "g++")
    system = [arg for d in _paddle_include_dirs() for arg in ("-isystem", d)]
    return [cxx, "-fsyntax-only", "-std=c++17", *ops._CXX_FLAGS, *_GPU_CXX_DEFINES, *STRICT_FLAGS,
            f"-I{ops.OPS_DIR}", *system, str(source)]


def check_strict() -> None:
    """Step 1 (module docstring); raises BuildCheckError with the compiler's output."""
    cmd = strict_command(ops.OPS_DIR / _OP_SOURCE)
    result = subprocess.run(cmd, capture_output=True, text=True)
    if result.returncode != 0 or result.stderr.strip():
        raise BuildCheckError(f"ops/{_OP_SOURCE} (GPU variant, warnings as errors) does not compile:\n"
                              f"{shlex.join(cmd)}\n{result.stderr.strip()}")


def nvcc_command(log_text: str) -> list[str]:
    """The nvcc command that compiled swap_cuda.cu, from the build's output."""
    for line in log_text.splitlines():
        words = line.split()
        if words and words[0].endswith("/nvcc") and any(w.endswith(_CUDA_SOURCE) for w in words):
            return words
    raise BuildCheckError(f"the build's output has no nvcc command compiling {_CUDA_SOURCE}")


def check_op(out: Path) -> Path:
    """Step 2 (module docstring): the library's path; raises BuildCheckError naming what failed."""
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / "op-build.log"
    with open(log_path, "w") as log:
        try:
            lib = ops.build_gpu_variant(out, log)
        except RuntimeError:
            text = log_path.read_text()
            errors = [line for line in text.splitlines() if "error" in line.lower()][:40]
            raise BuildCheckError("Paddle's JIT build of the GPU variant failed:\n" + "\n".join(errors)
                                  + f"\n(full output: {log_path})") from None
    command = nvcc_command(log_path.read_text())
    missing = [flag for flag in cuda_arch.gencode_flags() if flag not in command]
    if missing:
        raise BuildCheckError(f"the nvcc command for {_CUDA_SOURCE} lacks {' '.join(missing)} (see {log_path})")
    return lib


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastkv.kernels.gpu_build", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="directory for the library and build log")
    args = parser.parse_args(argv)
    if not os.environ.get("CUDA_HOME"):
        print("fastkv.kernels.gpu_build: set CUDA_HOME (scripts/check_gpu_build.sh does)", file=sys.stderr)
        return 2
    try:
        t0 = time.monotonic()
        check_strict()
        print(f"strict: ops/{_OP_SOURCE}, GPU variant, -Wall -Wextra -Werror: ok ({time.monotonic() - t0:.0f} s)")
        t0 = time.monotonic()
        lib = check_op(args.out)
        print(f"op: Paddle's JIT build with {_CUDA_SOURCE} ({' '.join(cuda_arch.gencode_flags())}): "
              f"{lib} ({time.monotonic() - t0:.0f} s)")
    except (BuildCheckError, ValueError) as exc:
        print(f"fastkv.kernels.gpu_build: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

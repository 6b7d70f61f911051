#!/usr/bin/env bash
# Compiles fastkv's GPU code with warnings as errors, on any machine (no GPU needed); CI runs it.
#   1. the C ABI library of ops/swap_cuda.cu for fastkv.kernels.cuda_arch's -gencode flags ($FASTKV_CUDA_ARCH,
#      default sm_80, sm_90 + PTX): python -m fastkv.kernels.cuda_abi --werror
#   2. the CUDA tests, tests/ops/test_cuda_abi.py (without a GPU, those that need one skip)
#   3. the Paddle op's GPU variant against the installed Paddle: python -m fastkv.kernels.gpu_build
#
# Usage: scripts/check_gpu_build.sh [--wheels]
# The CUDA toolkit is $CUDA_HOME, else nvcc's on PATH, if it holds what step 3 needs (nvcc,
# lib64/libcudart.so, the math libraries' and cuDNN's headers). Else, or with --wheels (CI), it
# is the pip wheels pinned in scripts/gpu_build_wheels.txt, installed once (about 2.7 GB; 2 GB
# to download) under ${FASTKV_CUDA_WHEELS:-~/.cache/fastkv/cuda-wheels} and reused while that
# file is unchanged. Needs Paddle (the CPU wheel will do), pytest, g++ and pip.
# The libraries and the op's build log go to a temporary directory, kept on failure
# ($FASTKV_GPU_BUILD_OUT: there instead, always kept).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS

use_wheels=0
case "${1:-}" in
    --wheels) use_wheels=1 ;;
    "") ;;
    *) echo "check_gpu_build.sh: unknown argument '$1' (usage: check_gpu_build.sh [--wheels])" >&2; exit 2 ;;
esac

complete_toolkit() {  # $1: a CUDA home; true when step 3 can build with it
    [[ -x $1/bin/nvcc && -e $1/lib64/libcudart.so ]] || return 1
    local h
    for h in cuda_runtime.h cublas_v2.h cudnn.h cufft.h curand.h cusolverDn.h cusparse.h; do
        [[ -e $1/include/$h || -e /usr/include/$h ]] || return 1
    done
}

wheel_toolkit() {  # installs the pinned wheels unless already there; prints their CUDA home
    local pins=scripts/gpu_build_wheels.txt base key tree
    base=${FASTKV_CUDA_WHEELS:-${XDG_CACHE_HOME:-$HOME/.cache}/fastkv/cuda-wheels}
    key=$(sha256sum "$pins" | cut -c1-16)
    tree=$base/$key
    mkdir -p "$base"
    exec 9>"$base/.lock"
    flock 9  # one install at a time; a second checker waits and reuses it
    if [[ ! -e $tree/.complete ]]; then
        echo "installing the CUDA wheels of $pins into $tree" >&2
        rm -rf "$tree" "$tree.partial"
        "$PY" -m pip install -q --no-deps --disable-pip-version-check --root-user-action=ignore \
            --target "$tree.partial" -r "$pins" >&2
        # The wheels' layout as a CUDA home: Paddle's JIT wants lib64/libcudart.so and the
        # headers under include/ (cuDNN's wheel has its own directory).
        local home=$tree.partial/nvidia/cu13 h
        ln -s lib "$home/lib64"
        ln -s libcudart.so.13 "$home/lib/libcudart.so"
        for h in "$tree.partial"/nvidia/cudnn/include/*; do
            ln -s "../../cudnn/include/${h##*/}" "$home/include/${h##*/}"
        done
        touch "$tree.partial/.complete"
        mv "$tree.partial" "$tree"
        # Trees of older pins are dead weight.
        find "$base" -mindepth 1 -maxdepth 1 -type d ! -name "$key" -exec rm -rf {} +
    fi
    exec 9>&-
    echo "$tree/nvidia/cu13"
}

home=""
if ((!use_wheels)); then
    if [[ -n ${CUDA_HOME:-} ]]; then
        home=$CUDA_HOME
    elif command -v nvcc >/dev/null; then
        home=$(dirname "$(dirname "$(readlink -f "$(command -v nvcc)")")")
    fi
    if [[ -n $home ]] && ! complete_toolkit "$home"; then
        echo "the CUDA toolkit at $home lacks what the Paddle op's GPU build needs: using the pinned wheels" >&2
        home=""
    fi
fi
[[ -n $home ]] || home=$(wheel_toolkit)
export CUDA_HOME=$home NVCC=$home/bin/nvcc PATH=$home/bin:$PATH
echo "== CUDA toolkit: $CUDA_HOME ($("$NVCC" --version | grep -o 'release [0-9.]*')) [$((SECONDS - started)) s]"

out=${FASTKV_GPU_BUILD_OUT:-$(mktemp -d)}
mkdir -p "$out"
trap 'rc=$?; if ((rc == 0)) && [[ -z ${FASTKV_GPU_BUILD_OUT:-} ]]; then rm -rf "$out"; elif ((rc != 0)); then echo "outputs kept in $out" >&2; fi' EXIT

step=$SECONDS
echo "== 1/3 C ABI library (ops/swap_cuda.cu), warnings as errors"
"$PY" -m fastkv.kernels.cuda_abi --werror --out "$out/abi"
echo "   ok [$((SECONDS - step)) s]"

step=$SECONDS
echo "== 2/3 CUDA tests (tests/ops/test_cuda_abi.py)"
"$PY" -m pytest -q -p no:cacheprovider tests/ops/test_cuda_abi.py
echo "   ok [$((SECONDS - step)) s]"

step=$SECONDS
echo "== 3/3 Paddle op, GPU variant (ops/swap_op.cc + ops/swap_cuda.cu)"
"$PY" -m fastkv.kernels.gpu_build --out "$out/op"
echo "   ok [$((SECONDS - step)) s]"
echo "GPU build check passed in $((SECONDS - started)) s"

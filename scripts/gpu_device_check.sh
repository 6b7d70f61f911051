#!/usr/bin/env bash
# The GPU checks on a GPU machine, without Paddle and without network: from the repo root,
#   OUT=/some/dir scripts/gpu_device_check.sh
#   1. build: the C ABI library of ops/swap_cuda.cu with nvcc, warnings as errors
#   2. tests: tests/ops/test_cuda_abi.py, its device tests included (a skip fails this step)
#   3. swap:  scripts/gpu_swap_check.py: byte-exact against the numpy reference, then GB/s per
#      direction and mode against one large pinned cudaMemcpyAsync of the same bytes
# Each step's log goes to $OUT/<step>.log; $OUT/gpu_swap.json is the swap check's result and
# $OUT/summary.json every step's exit status and seconds. Exits non-zero if a step failed.
# Needs a CUDA driver, nvcc ($NVCC, PATH, /usr/local/cuda or the pip wheel's) and a python3 with
# numpy and pytest ($PYTHON); fastkv's imports on this path need nothing else. About a minute;
# each step has a time limit, all of them together under 6 minutes.
set -uo pipefail  # not -e: every step runs and reports
cd "$(dirname "$0")/.."
OUT=${OUT:-$PWD/gpu-check-out}
mkdir -p "$OUT"
: >"$OUT/summary.txt"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
started=$SECONDS

PY=""
for candidate in ${PYTHON:-} python3 python python3.12; do
    if command -v "$candidate" >/dev/null && "$candidate" -c "import numpy, pytest" 2>/dev/null; then
        PY=$candidate
        break
    fi
done
if [[ -z $PY ]]; then
    echo "gpu_device_check.sh: no python with numpy and pytest (set PYTHON)" | tee -a "$OUT/summary.txt" >&2
    exit 2
fi
NVCC=${NVCC:-$("$PY" -c "from fastkv.kernels import cuda_abi; print(cuda_abi.find_nvcc() or '')")}
if [[ -z $NVCC ]]; then
    echo "gpu_device_check.sh: nvcc not found (set NVCC)" | tee -a "$OUT/summary.txt" >&2
    exit 2
fi
export NVCC

{
    echo "python: $PY ($("$PY" -V 2>&1)), numpy $("$PY" -c 'import numpy; print(numpy.__version__)')"
    echo "nvcc: $NVCC ($("$NVCC" --version | grep -o 'release [0-9.]*'))"
    timeout 30 nvidia-smi --query-gpu=name,driver_version,memory.total,pcie.link.gen.current,pcie.link.width.current \
        --format=csv 2>&1
    echo "commit: $(git rev-parse HEAD 2>/dev/null || echo unknown)"
} >"$OUT/env.txt" 2>&1

work=$(mktemp -d)  # the built libraries: not worth bringing back
trap 'rm -rf "$work"' EXIT
steps_json=()
failed=0
run_step() {  # name, seconds allowed, command...
    local name=$1 limit=$2 t0=$SECONDS rc
    shift 2
    timeout --kill-after=10 "$limit" "$@" >"$OUT/$name.log" 2>&1
    rc=$?
    if [[ $name == tests ]] && ((rc == 0)) && grep -q "skipped" "$OUT/$name.log"; then
        rc=3  # the device tests skipped: no GPU seen
    fi
    ((rc == 0)) || failed=1
    echo "$name: rc=$rc, $((SECONDS - t0)) s (log: $OUT/$name.log)" | tee -a "$OUT/summary.txt"
    steps_json+=("\"$name\": {\"rc\": $rc, \"seconds\": $((SECONDS - t0))}")
}

run_step build 100 "$PY" -m fastkv.kernels.cuda_abi --werror --out "$work/lib"
# --noconftest: tests/conftest.py needs hypothesis (not here) for its profiles and checks
# /dev/shm for leaks, which these ctypes tests cannot cause.
run_step tests 110 "$PY" -m pytest -q -rs -p no:cacheprovider --noconftest tests/ops/test_cuda_abi.py \
    --junitxml="$OUT/test_cuda_abi.xml"
run_step swap 120 "$PY" scripts/gpu_swap_check.py --build-dir "$work/swap-lib"
tail -n 1 "$OUT/swap.log" | grep '^{' >"$OUT/gpu_swap.json" || echo "null" >"$OUT/gpu_swap.json"

summary="{$(IFS=,; echo "${steps_json[*]}"), \"seconds\": $((SECONDS - started)), \"gpu_swap\": $(cat "$OUT/gpu_swap.json")}"
echo "$summary" >"$OUT/summary.json"
echo "total: $((SECONDS - started)) s; $( ((failed)) && echo FAILED || echo ok)" | tee -a "$OUT/summary.txt"
sed -n '/^[0-9]* blocks/,/^memcpy_h2d/p' "$OUT/swap.log"
exit "$failed"

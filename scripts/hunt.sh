#!/usr/bin/env bash
# The randomized hunt to take before stopping work: every state machine in tests/stateful under
# HYPOTHESIS_PROFILE=long (10,000 examples each, tests/conftest.py), in two pytest processes side
# by side (the scheduler machine, the slowest, alone in one), about 30 minutes on two cores.
#
# Usage: scripts/hunt.sh [SEED]    (SEED: every test's hypothesis seed, FASTKV_HUNT_SEED in
#                                   tests/conftest.py; default: a random one)
# Environment: FASTKV_HUNT_DIR   where the run's record, logs and example database go
#                                (default: .hypothesis/hunts/<UTC time>-<seed>)
#              PYTHONHASHSEED    the hash order the run sees (default: the seed's), recorded
#              FASTKV_LONG_EXAMPLES  examples per machine (default 10,000), recorded
# The record (hunt.txt there) names the commit, the seed, PYTHONHASHSEED and the database; a
# failure is saved in that database, and the command printed at the end replays it (the
# database's failing example first, then the same seeded run).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
seed=${1:-$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}
stamp=$(date -u +%Y%m%dT%H%M%SZ)
dir=${FASTKV_HUNT_DIR:-.hypothesis/hunts/$stamp-$seed}
mkdir -p "$dir"
dir=$(cd "$dir" && pwd)
db=$dir/examples
export HYPOTHESIS_PROFILE=long FASTKV_HYPOTHESIS_DB=$db FASTKV_HUNT_SEED=$seed
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONHASHSEED=${PYTHONHASHSEED:-$(( seed % 4294967296 ))}
replay="cd $PWD && PYTHONHASHSEED=$PYTHONHASHSEED HYPOTHESIS_PROFILE=long FASTKV_HYPOTHESIS_DB=$db FASTKV_HUNT_SEED=$seed"
[[ -n ${FASTKV_LONG_EXAMPLES:-} ]] && replay+=" FASTKV_LONG_EXAMPLES=$FASTKV_LONG_EXAMPLES"
replay+=" PYTHONPATH=$PWD $PY -m pytest --timeout 0 -x -q"
{
    echo "commit        $(git rev-parse HEAD 2>/dev/null)$(git diff --quiet HEAD 2>/dev/null || echo ' (with local changes)')"
    echo "started       $stamp"
    echo "seed          $seed"
    echo "PYTHONHASHSEED $PYTHONHASHSEED"
    echo "examples      ${FASTKV_LONG_EXAMPLES:-10000} per machine"
    echo "database      $db"
    echo "host          $(uname -n), $(nproc) cores, $(lscpu 2>/dev/null | sed -n 's/^Model name: *//p')"
} > "$dir/hunt.txt"
cat "$dir/hunt.txt"

groups=("tests/stateful/test_sched_machine.py"
        "tests/stateful --deselect tests/stateful/test_sched_machine.py::test_scheduler_machine")
pids=()
for i in "${!groups[@]}"; do
    # shellcheck disable=SC2086  # a group is a list of pytest arguments
    $PY -m pytest --timeout 0 -q -p no:cacheprovider ${groups[$i]} \
        > "$dir/group$i.log" 2>&1 &
    pids+=($!)
done
rc=0
for i in "${!pids[@]}"; do
    if wait "${pids[$i]}"; then
        echo "group $i passed: ${groups[$i]} ($(tail -n 1 "$dir/group$i.log"))"
    else
        rc=1
        echo "group $i FAILED: ${groups[$i]} (log: $dir/group$i.log)"
    fi
done
elapsed=$(( $(date +%s) - $(date -u -d "${stamp:0:8} ${stamp:9:2}:${stamp:11:2}:${stamp:13:2}" +%s) ))
echo "elapsed       ${elapsed}s" | tee -a "$dir/hunt.txt"
echo "result        $([[ $rc == 0 ]] && echo passed || echo FAILED)" >> "$dir/hunt.txt"
if [[ $rc != 0 ]]; then
    echo "replay a failure (its example is in the database above):"
    echo "  $replay <the failing test>"
fi
exit $rc

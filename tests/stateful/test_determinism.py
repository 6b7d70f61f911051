"""The CI profile draws the same examples under any PYTHONHASHSEED: a strategy that orders by
set iteration (of str or bytes), or a machine whose decisions do, would draw others."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def fingerprint(target: str, examples: int, hashseed: int) -> str:
    env = {**os.environ, "PYTHONHASHSEED": str(hashseed), "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "tests.stateful.fingerprint", target, str(examples)], cwd=ROOT,
                         env=env, capture_output=True, text=True, timeout=600, check=True)
    return out.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("target", ["tests.stateful.test_sched_machine:SchedulerMachine",
                                    "tests.stateful.test_manager_machine:ManagerMachine"])
def test_the_ci_examples_do_not_depend_on_the_hash_seed(target):
    prints = {seed: fingerprint(target, 40, seed) for seed in (1, 2, 3)}  # an order of a few strings: 3 can tell
    assert len(set(prints.values())) == 1, prints

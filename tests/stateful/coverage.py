"""What a state machine reached under the CI profile, checked against the cases it must reach.

Each machine lists its cases (``CASES``) and records the ones a run reached (``REACHED``,
also reported with ``hypothesis.event``). Under the CI profile (derandomized, so the same
examples every run, on a clock of the machine's own: the same decisions on any machine and
load) a case missed that is not a known gap fails. The examples depend on hypothesis's
version, which setup.py pins for that reason.
"""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test


def run_and_check_coverage(machine: type, cases: set[str], reached: Counter, known_gaps: set[str]) -> None:
    reached.clear()
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=80))
    now, ci = settings.default, settings.get_profile("ci")
    if not (now.derandomize and now.max_examples >= ci.max_examples):
        return  # a random profile explores; only the fixed CI examples are held to the list
    missed = cases - reached.keys()
    assert missed <= known_gaps, f"the CI profile no longer reaches {sorted(missed - known_gaps)}"

"""What a state machine reached under the CI profile, against the cases it must reach.

Each machine lists its cases (``CASES``) and records the ones a run reached (``REACHED``,
also reported with ``hypothesis.event``). Under the CI profile (derandomized) a run must reach
all but a few of them. Which few varies: hypothesis derives the fixed examples from the test's
identity, and a checkout in another directory draws others; runs here missed 5 to 8 of the
scheduler's 37 cases and the same 5 of the manager's. The bound catches a rule or a scheduler
change that stops copies from being exercised; reaching every case is still open (issue 16).
"""
from __future__ import annotations

from collections import Counter

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test


def run_and_check_coverage(machine: type, cases: set[str], reached: Counter, max_missed: int) -> None:
    reached.clear()
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=80))
    now, ci = settings.default, settings.get_profile("ci")
    if not (now.derandomize and now.max_examples >= ci.max_examples):
        return  # a random profile explores; only the CI profile's examples are held to the bound
    missed = sorted(cases - reached.keys())
    assert len(missed) <= max_missed, f"the CI profile misses {len(missed)} of {len(cases)} cases: {missed}"

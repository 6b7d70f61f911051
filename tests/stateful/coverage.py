"""What a state machine reached under the CI profile, against the cases it must reach.

Each machine lists its cases (``CASES``) and records the ones a run reached (``REACHED``,
also reported with ``hypothesis.event``). Under the CI profile (derandomized) a run must reach
all but ``max_missed`` of them. Hypothesis derives the fixed examples from the test's identity,
so a checkout in another directory, or any edit of the machine, draws other examples: the
machines steer into the rare cases with targeted rules so that the bound holds under any seed
(check with a few ``@seed``s, not only the CI one). Both the manager and the scheduler machine
reach every case. Under any other profile the bound is not checked, and the run says so with a
``CoverageNotChecked`` warning naming the cases it missed.
"""
from __future__ import annotations

import warnings
from collections import Counter

from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test


class CoverageNotChecked(UserWarning):
    """A machine ran under another profile than CI's: its cases were not held to the bound."""


def run_and_check_coverage(machine: type, cases: set[str], reached: Counter, max_missed: int) -> None:
    reached.clear()
    run_state_machine_as_test(machine, settings=settings(stateful_step_count=80))
    now, ci = settings.default, settings.get_profile("ci")
    missed = sorted(cases - reached.keys())
    if not (now.derandomize and now.max_examples >= ci.max_examples):
        # a random profile explores; only the CI profile's examples are held to the bound, but
        # what this run missed is said, in pytest's warnings summary (-W error makes it fail)
        warnings.warn(CoverageNotChecked(
            f"{machine.__name__}: coverage not checked outside the CI profile (CI=true); this run reached "
            f"{len(cases) - len(missed)} of {len(cases)} cases, missed {missed}"), stacklevel=2)
        return
    assert len(missed) <= max_missed, f"the CI profile misses {len(missed)} of {len(cases)} cases: {missed}"

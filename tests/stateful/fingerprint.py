"""The examples a state machine draws under the CI profile, as one hash: sha256 over each
example's choices (their types, values and bounds: a draw from a list of another length is
another draw), in the order hypothesis ran them, and the cases the machine reached (``REACHED``):
what the examples did, not only what they drew.

    python -m tests.stateful.fingerprint tests.stateful.test_sched_machine:SchedulerMachine [N]

prints ``<Class>: <examples run> examples, sha256 <hash>`` (N: max_examples, default the CI
profile's 500). Two runs print the same line when the profile draws the same examples, whatever
the machine or PYTHONHASHSEED (tests/stateful/test_determinism.py).
"""
from __future__ import annotations

import hashlib
import importlib
import sys

from hypothesis import settings
from hypothesis.internal.conjecture import engine
from hypothesis.stateful import run_state_machine_as_test

import tests.conftest  # noqa: F401  (registers the profiles)


def fingerprint(target: str, max_examples: int | None = None) -> tuple[int, str]:
    """(examples run, sha256 of their choices) of ``module:Class`` under the CI profile."""
    seen: list[str] = []
    run = engine.ConjectureRunner.test_function

    def recorded(self, data):
        try:
            return run(self, data)
        finally:
            seen.append(repr([(n.type, n.value, sorted(n.constraints.items())) for n in data.nodes]))

    module, cls = target.split(":")
    mod = importlib.import_module(module)
    if hasattr(mod, "event"):
        mod.event = lambda *_: None  # hypothesis.event needs a test context
    reached = getattr(mod, "REACHED", None)  # what the machine did: the cases its examples reached
    if reached is not None:
        reached.clear()
    ci = settings.get_profile("ci")
    engine.ConjectureRunner.test_function = recorded
    try:
        run_state_machine_as_test(getattr(mod, cls), settings=settings(
            ci, stateful_step_count=80, max_examples=max_examples or ci.max_examples))
    finally:
        engine.ConjectureRunner.test_function = run
    if reached is not None:
        seen.append(repr(sorted(reached.items())))
    return len(seen), hashlib.sha256("\n".join(seen).encode()).hexdigest()


if __name__ == "__main__":
    n, digest = fingerprint(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else None)
    print(f"{sys.argv[1].split(':')[1]}: {n} examples, sha256 {digest}")

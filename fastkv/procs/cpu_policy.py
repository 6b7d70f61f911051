"""The Linux scheduling policy of the thread that drives the engine (``--engine-cpu-policy``).

While a step runs the engine sleeps on its inbox, and the worker's output (or a copy's
completion) wakes it. Under the default policy (SCHED_OTHER) a task that wakes preempts the
task running on the core it lands on when it has slept longer, and on a host with few free
cores that is often the worker that woke it: the worker's post of its output returns only
once the engine has applied that output and planned its next step, so the GPU waits for the
engine after all. SCHED_BATCH ("batch") takes the engine out of wake-up preemption: it runs on
a free core, or when the running task's slice ends. With async scheduling the next step is on
the worker's ring already, so the engine loses nothing by waiting its turn. Setting it needs no
privilege; it applies to the calling thread and to the threads it starts afterwards.
"""
from __future__ import annotations

import os

CPU_POLICIES = ("batch", "normal")


def apply(policy: str) -> str:
    """Give the calling thread ``policy``; returns the policy it runs under now: "normal" where
    the platform has no SCHED_BATCH (not Linux) or refuses it."""
    if policy not in CPU_POLICIES:
        raise ValueError(f"engine CPU policy must be one of {CPU_POLICIES}, got {policy!r}")
    want = getattr(os, "SCHED_BATCH" if policy == "batch" else "SCHED_OTHER", None)
    if want is None or not hasattr(os, "sched_setscheduler"):
        return "normal"
    try:
        os.sched_setscheduler(0, want, os.sched_param(0))
    except OSError:
        pass  # refused (a container's seccomp profile): the thread keeps the policy it had
    return current()


def current() -> str:
    """The calling thread's policy, as ``apply`` names it ("other" for any other policy)."""
    if not hasattr(os, "sched_getscheduler"):
        return "normal"
    got = os.sched_getscheduler(0)
    return "batch" if got == os.SCHED_BATCH else "normal" if got == os.SCHED_OTHER else "other"

"""Prefetch policies: how long a new request waits for its storage lookup before admission.

SGLang HiCache's names and meaning, applied to the LOOKUP that asks the shared store what it
holds (``fastkv.engine.lookup``): ``best_effort`` never holds a request back (it goes with what
is already known to be stored), ``wait_complete`` holds it until the answer comes (a failed or
timed-out LOOKUP task answers too: ``task_timeout_s`` bounds it), ``timeout`` holds it at most
``base + per_1k_tokens x prompt tokens / 1000`` seconds: a long prompt has more to gain from its
answer. ``timeout`` with the per-token part 0 is the engine's bounded lookup wait, the default;
where lookups take longer than that bound the engine stretches it to twice their recent round
trip, at most ten times (``fastkv.engine.lookup``).
A LOAD, once admission planned it, is always waited for (the request is LOADING, and requests
that need no copy are admitted past it, ``fastkv.sched.admission``).
"""
from __future__ import annotations

import math

PREFETCH_POLICIES = ("best_effort", "wait_complete", "timeout")


def lookup_wait_s(policy: str, base_s: float, per_1k_tokens_s: float, num_tokens: int) -> float:
    """Seconds a request of ``num_tokens`` prompt tokens may wait for its lookup's answer."""
    if policy == "best_effort":
        return 0.0
    if policy == "wait_complete":
        return math.inf
    if policy == "timeout":
        return base_s + per_1k_tokens_s * num_tokens / 1000
    raise ValueError(f"prefetch policy must be one of {PREFETCH_POLICIES}, got {policy!r}")

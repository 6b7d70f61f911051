"""validate_plan checks the whole plan in a few numpy calls; ``_validate_each`` is its
per-sequence definition. On every plan, valid or not, the two must agree: accept both, or
raise the same message."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastkv.sched.output import SeqWork, StepPlan, _validate_each, validate_plan

BLOCKS = 12
# per sequence: mostly valid, each fault now and then ("overlap": valid alone, may write a slot another writes)
FAULTS = ("none",) * 6 + ("overlap", "overlap", "short", "repeat", "range", "token", "empty", "start")


@st.composite
def plans(draw) -> tuple[StepPlan, int]:
    bs = draw(st.integers(1, 4))
    seqs, free = [], list(range(BLOCKS))
    for _ in range(draw(st.integers(1, 5))):
        start, n = draw(st.integers(0, 9)), draw(st.integers(1, 5))
        need = -(-(start + n) // bs)
        fault = draw(st.sampled_from(FAULTS))
        if fault == "overlap" and need <= BLOCKS:  # valid alone; its blocks may be in other tables
            table = draw(st.permutations(range(BLOCKS)))[:need]
        elif fault == "none" and len(free) >= need:  # valid: blocks no other sequence writes
            table = [free.pop(draw(st.integers(0, len(free) - 1))) for _ in range(need)]
        else:  # short, a block twice, or one out of range
            table = list(draw(st.permutations(range(BLOCKS))))[:min(need, BLOCKS)]
            if fault == "short" or need > BLOCKS:
                table = table[:draw(st.integers(0, len(table) - 1))]
            elif fault == "repeat" and need > 1:
                table[draw(st.integers(1, need - 1))] = table[0]
            elif fault == "range":
                table[draw(st.integers(0, need - 1))] = draw(st.sampled_from([-1, BLOCKS]))
        tokens = draw(st.lists(st.integers(0, 50), min_size=n, max_size=n))
        if fault == "token":
            tokens[draw(st.integers(0, n - 1))] = -1
        seqs.append(SeqWork(draw(st.integers(0, 30)), np.array([] if fault == "empty" else tokens, np.int64),
                            -1 if fault == "start" else start, np.array(table, np.int64), True))
    return StepPlan(7, seqs), bs


def outcome(check, plan: StepPlan, bs: int) -> str:
    try:
        check(plan, bs, BLOCKS)
    except ValueError as exc:
        return str(exc)
    return "ok"


@settings(max_examples=600)
@given(plans())
def test_the_whole_plan_check_agrees_with_the_per_sequence_definition(case):
    plan, bs = case
    assert outcome(validate_plan, plan, bs) == outcome(_validate_each, plan, bs)


def test_both_outcomes_are_reached():
    """The strategy above is no use if every plan is bad (or good): one of each, by hand."""
    good = StepPlan(1, [SeqWork(1, np.array([3, 4]), 2, np.array([0, 1]), True),
                        SeqWork(2, np.array([5]), 0, np.array([2]), True)])
    validate_plan(good, 2, BLOCKS)
    shared_slot = StepPlan(2, [SeqWork(1, np.array([3]), 0, np.array([4]), True),
                               SeqWork(2, np.array([5]), 0, np.array([4]), True)])
    with pytest.raises(ValueError, match="step 2: two requests write the same KV slot"):
        validate_plan(shared_slot, 2, BLOCKS)
    repeat = StepPlan(3, [SeqWork(1, np.array([3, 4, 5]), 0, np.array([4, 4]), True)])
    with pytest.raises(ValueError, match=r"request 1 block table \[4, 4\] repeats a block"):
        validate_plan(repeat, 2, BLOCKS)
    with pytest.raises(TypeError, match="takes a StepPlan"):
        validate_plan([], 2, BLOCKS)

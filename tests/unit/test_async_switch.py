"""The async-scheduling switch (flag > config file > default, into the RunSpec) and the
worker's side of it: placeholders filled in from the rank's own samples of the step before."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.cli import JobConfig, _flags, build_parser
from fastkv.engine import protocol
from fastkv.sched.output import PLACEHOLDER, SeqWork, StepPlan


def job(tmp_path, text: str | None, *argv: str) -> JobConfig:
    path = None
    if text is not None:
        path = tmp_path / "job.toml"
        path.write_text(text)
    return JobConfig.from_sources(path, _flags(build_parser().parse_args(list(argv))))


@pytest.mark.parametrize("text,argv,want", [
    (None, [], True),  # the default
    ('async_scheduling = "off"\n', [], False),  # the file over the default
    ('async_scheduling = "off"\n', ["--async-scheduling", "on"], True),  # the flag over the file
    (None, ["--async-scheduling", "off"], False),
])
def test_the_switch_reaches_the_run_spec(tmp_path, text, argv, want):
    cfg = job(tmp_path, text, *argv)
    assert cfg.to_spec("r", tmp_path).async_scheduling is want


def test_a_bad_value_names_the_setting(tmp_path):
    with pytest.raises(ValueError, match="async_scheduling"):
        job(tmp_path, 'async_scheduling = "maybe"\n')
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--async-scheduling", "maybe"])


def test_placeholders_take_the_rank_own_sample_of_the_step_before():
    plan = StepPlan(8, [SeqWork(1, np.array([PLACEHOLDER]), 9, np.arange(3), True),
                        SeqWork(2, np.array([5, 6]), 0, np.arange(1), True)])
    wire = protocol.msg_to_plan(protocol.plan_to_msg(plan))
    protocol.fill_placeholders(wire, {1: 42, 3: 7})
    assert wire.seqs[0].token_ids.tolist() == [42] and wire.seqs[1].token_ids.tolist() == [5, 6]


def test_a_placeholder_with_no_sample_names_the_step_and_request():
    plan = StepPlan(8, [SeqWork(1, np.array([PLACEHOLDER]), 9, np.arange(3), True)])
    with pytest.raises(ValueError, match=r"step 8: request 1 .*--async-scheduling off"):
        protocol.fill_placeholders(plan, {})

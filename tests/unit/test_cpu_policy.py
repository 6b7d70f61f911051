"""The engine thread's CPU policy: set on the calling thread, inherited by the threads it starts,
named in the run spec by flag > config file > default, refused in one line when misspelt."""
from __future__ import annotations

import os
import sys
import threading

import pytest

from fastkv.cli import JobConfig, _flags, build_parser
from fastkv.procs import cpu_policy

linux = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SCHED_BATCH is Linux's")


def in_thread(fn):
    """``fn()`` in a thread of its own: the test process keeps its policy."""
    out = {}
    t = threading.Thread(target=lambda: out.setdefault("v", fn()))
    t.start()
    t.join()
    return out["v"]


@linux
def test_batch_is_set_on_the_calling_thread_and_inherited_by_its_threads():
    def body():
        got = cpu_policy.apply("batch")
        child = in_thread(lambda: os.sched_getscheduler(0))
        back = cpu_policy.apply("normal")
        return got, os.sched_getscheduler(0), child, back

    res = in_thread(body)
    got, after_normal, child, back = res
    assert got == "batch" and child == os.SCHED_BATCH, res
    assert back == "normal" and after_normal == os.SCHED_OTHER, res
    assert cpu_policy.current() == "normal", "the test's own thread changed policy"


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="'fast'"):
        cpu_policy.apply("fast")


@pytest.mark.parametrize("text,argv,want", [
    (None, [], "batch"),
    ('engine_cpu_policy = "normal"\n', [], "normal"),
    ('engine_cpu_policy = "normal"\n', ["--engine-cpu-policy", "batch"], "batch"),
])
def test_the_setting_reaches_the_run_spec(tmp_path, text, argv, want):
    path = None
    if text is not None:
        path = tmp_path / "job.toml"
        path.write_text(text)
    cfg = JobConfig.from_sources(path, _flags(build_parser().parse_args(list(argv))))
    assert cfg.to_spec("r", tmp_path).engine_cpu_policy == want


def test_a_misspelt_policy_in_a_config_file_names_the_setting():
    with pytest.raises(ValueError, match="setting 'engine_cpu_policy' must be one of"):
        JobConfig(engine_cpu_policy="batched")

"""The PaddleFormers runners (each model family) in this process, driven through adversarial
plans (random batches, chunked prefills, recompute preemptions that keep a prefix, blocks at
random ids): every request's tokens equal the oracle (the library's no-cache forward, greedy)
on the same weights, with the device tier as numpy views (the CPU build) and as Paddle tensors
written by index_put (an accelerator's path)."""
from __future__ import annotations

import numpy as np
import pytest

from tests.optional import require_paddleformers

require_paddleformers()  # a skip without the models extra, a failure under CI

import paddle  # noqa: E402

from fastkv.engine.runners import runner_class  # noqa: E402
from tests.e2e.test_engine_paddleformers import FAMILIES, MAX_NEW, PROMPTS, layout, options, oracle  # noqa: E402
from tests.runner_driver import drive  # noqa: E402

BLOCKS = 96


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tensors", ["numpy", "paddle"])
def test_adversarial_plans_give_the_oracle_tokens(family, tensors):
    lay = layout(family, 1)
    make = (lambda: np.zeros(lay.device_shape(BLOCKS), np.float32)) if tensors == "numpy" else \
        (lambda: paddle.zeros(lay.device_shape(BLOCKS), "float32"))
    k, v = [make() for _ in range(lay.num_layers)], [make() for _ in range(lay.num_layers)]
    runner = runner_class(f"paddleformers:{family}")(lay, 0, 1, k, v, **options(family))
    if tensors == "paddle":  # a CPU tensor would be written through its numpy view: take the other path
        runner.k_views = runner.v_views = [None] * lay.num_layers
    out, stats = drive(runner, dict(enumerate(PROMPTS.values())), MAX_NEW, np.random.default_rng(5), max_chunk=5,
                       preempt_prob=0.25)
    assert stats.preemptions > 0 and stats.max_batch > 1, stats
    want, _ = oracle(family)
    assert out == dict(enumerate(want.values()))
    assert float(np.abs(np.asarray(k[0])).sum()) > 0  # written in place, in the tier's own memory


@pytest.mark.parametrize("family", FAMILIES)
def test_a_token_outside_the_vocab_is_named(family):
    from fastkv.sched.output import SeqWork, StepPlan

    lay = layout(family, 1)
    k = [np.zeros(lay.device_shape(4), np.float32) for _ in range(lay.num_layers)]
    runner = runner_class(f"paddleformers:{family}")(lay, 0, 1, k, [c.copy() for c in k], **options(family))
    with pytest.raises(ValueError, match=r"request 7 has a token id outside the vocab \[0, 256\)"):
        runner.step(StepPlan(0, [SeqWork(7, np.array([3, 256]), 0, np.arange(4), True)]))

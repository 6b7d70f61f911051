"""tp 2 of the PaddleFormers runners (each model family) in two real worker processes: each
rank's shard of the library's model, partial sums combined through ShmCollective, against the
whole model (tp 1). A wrong split (a fused layer's columns cut in the wrong places, a head count
left global) fails here: its logits are another model's.

Row-parallel sums round differently from one GEMM, so the logits may differ in the last bits;
the test measures by how much, against the least top-2 margin of the tokens: while the
difference stays below half the margin no argmax can flip (the e2e tests check the tokens)."""
from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np
import pytest

pytest.importorskip("paddleformers")

from fastkv.ipc.collective import ShmCollective  # noqa: E402
from tests.conftest import shm_test_name  # noqa: E402
from tests.e2e.test_engine_paddleformers import FAMILIES, OPTIONS, PROMPTS, layout, oracle  # noqa: E402


def logits(family: str, tp: int, rank: int, collective: ShmCollective | None) -> dict[str, np.ndarray]:
    """The runner's model on prompt + the oracle's output, one forward each, no cache."""
    import paddle

    from fastkv.engine.runners import runner_class

    lay = layout(tp)
    k = [np.zeros(lay.device_shape(4), np.float32) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(4), np.float32) for _ in range(lay.num_layers)]
    runner = runner_class(f"paddleformers:{family}")(lay, rank, tp, k, v, collective=collective, **OPTIONS)
    want, _ = oracle(family)
    out = {}
    with paddle.no_grad():
        for rid, prompt in PROMPTS.items():
            ids = paddle.to_tensor([prompt + want[rid]])
            out[rid] = runner.model(ids, return_dict=True).logits[0, len(prompt) - 1 : -1].numpy()
    return out


def worker(family: str, name: str, rank: int, results) -> None:
    with ShmCollective.attach(name, rank, timeout_s=60) as c:
        results.put((rank, logits(family, 2, rank, c)))


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_logits_stay_within_half_the_token_margin_of_tp1(family):
    want, margin = oracle(family)
    tp1 = logits(family, 1, 0, None)
    for rid, lg in tp1.items():
        assert np.argmax(lg, axis=1).tolist() == want[rid]
    name = shm_test_name()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with ShmCollective.create(name, 2, slot_bytes=1 << 20):
        procs = [ctx.Process(target=worker, args=(family, name, r, results), daemon=True) for r in range(2)]
        for p in procs:
            p.start()
        try:
            got = dict(results.get(timeout=120) for _ in procs)
        except queue.Empty:
            raise AssertionError(f"tp workers did not finish: exit codes {[p.exitcode for p in procs]}") from None
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
    assert [p.exitcode for p in procs] == [0, 0]
    diff = max(float(np.abs(got[r][rid] - tp1[rid]).max()) for r in range(2) for rid in PROMPTS)
    print(f"tp2 vs tp1: largest logit difference {diff:.3g}, least top-2 margin {margin:.3g}")
    for rid in PROMPTS:
        np.testing.assert_array_equal(got[0][rid], got[1][rid])  # the collective adds in rank order everywhere
        assert np.argmax(got[0][rid], axis=1).tolist() == want[rid], rid
    assert diff < margin / 2, (diff, margin)

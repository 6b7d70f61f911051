"""tp 2 of the PaddleFormers runners (each model family) in two real worker processes: each
rank's shard of the library's model, partial sums combined through ShmCollective, against the
whole model (tp 1). A wrong split (a fused layer's columns cut in the wrong places, a head count
left global) fails here: its logits are another model's.

Row-parallel sums round differently from one GEMM, so the logits may differ in the last bits;
the test measures by how much, against the least top-2 margin of the tokens: while the
difference stays below half the margin no argmax can flip (the e2e tests check the tokens).
Equal logits alone would also pass a "tp 2" that ran the whole model on each rank, so each
rank's projections must be its slice of the whole model's: column shards of the projections
into heads and the MLP's gate and up (a fused gate|up per half), row shards of o and down
(whose partial sums the collective adds)."""
from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np
import pytest

from tests.optional import require_paddleformers

require_paddleformers()  # a skip without the models extra, a failure under CI

from fastkv.ipc.collective import ShmCollective  # noqa: E402
from tests.conftest import shm_test_name  # noqa: E402
from tests.e2e.test_engine_paddleformers import FAMILIES, PROMPTS, layout, options, oracle  # noqa: E402

# per family: column-sharded projections, those fused of two halves sharded per half, row-sharded ones
SHARDS = {
    "llama": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"), (),
              ("self_attn.o_proj", "mlp.down_proj")),
    "ernie4_5": (("self_attn.qkv_proj",), ("mlp.up_gate_proj",), ("self_attn.o_proj", "mlp.down_proj")),
    "gemma3": (("self_attn.qkv_proj",), ("mlp.up_gate_proj",), ("self_attn.o_proj", "mlp.down_proj")),
    # the experts are replicated; the sinks are checked per query head in expected_shard
    "gpt_oss": (("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.sinks"), (),
                ("self_attn.o_proj",)),
}


def logits(family: str, tp: int, rank: int, collective: ShmCollective | None) -> tuple[dict[str, np.ndarray],
                                                                                       dict[str, np.ndarray]]:
    """The runner's model on prompt + the oracle's output, one forward each, no cache; and the
    weights of its projections, by layer and name."""
    import paddle

    from fastkv.engine.runners import runner_class

    lay = layout(family, tp)
    k = [np.zeros(lay.device_shape(4), np.float32) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(4), np.float32) for _ in range(lay.num_layers)]
    runner = runner_class(f"paddleformers:{family}")(lay, rank, tp, k, v, collective=collective, **options(family))
    want, _ = oracle(family)
    out = {}
    with paddle.no_grad():
        for rid, prompt in PROMPTS.items():
            ids = paddle.to_tensor([prompt + want[rid]])
            out[rid] = runner.model(ids, return_dict=True).logits[0, len(prompt) - 1 : -1].numpy()
    names = [n for group in SHARDS[family] for n in group]
    weights = {f"{i}.{name}": weight(layer, name)
               for i, layer in enumerate(runner.model.model.layers) for name in names}
    return out, weights


def weight(layer, name: str) -> np.ndarray:
    """A decoder layer's projection weight (or parameter, e.g. the sinks) by its dotted name."""
    part, attr = name.split(".")
    got = getattr(getattr(layer, part), attr)
    return getattr(got, "weight", got).numpy()


def worker(family: str, name: str, rank: int, results) -> None:
    with ShmCollective.attach(name, rank, timeout_s=60) as c:
        results.put((rank, logits(family, 2, rank, c)))


def expected_shard(family: str, key: str, w: np.ndarray, rank: int) -> np.ndarray:
    """Rank ``rank``'s slice of the whole model's weight ``w`` (paddle's Linear weight is [in, out]:
    a column shard splits out, a row shard in)."""
    cols, fused, _rows = SHARDS[family]
    if w.ndim == 1:  # per query head (the sinks)
        part = len(w) // 2
        return w[rank * part:(rank + 1) * part]
    if key.endswith(cols):
        part = w.shape[1] // 2
        return w[:, rank * part:(rank + 1) * part]
    if key.endswith(fused):
        halves = np.split(w, 2, axis=1)
        part = halves[0].shape[1] // 2
        return np.concatenate([h[:, rank * part:(rank + 1) * part] for h in halves], axis=1)
    part = w.shape[0] // 2
    return w[rank * part:(rank + 1) * part]


@pytest.mark.parametrize("family", FAMILIES)
def test_tp2_logits_stay_within_half_the_token_margin_of_tp1(family):
    want, margin = oracle(family)
    tp1, whole = logits(family, 1, 0, None)
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
    for r in range(2):
        shards = got[r][1]
        assert shards.keys() == whole.keys()
        for key, w in whole.items():
            np.testing.assert_array_equal(shards[key], expected_shard(family, key, w, r), err_msg=f"rank {r} {key}")
    got = {r: lg for r, (lg, _) in got.items()}
    diff = max(float(np.abs(got[r][rid] - tp1[rid]).max()) for r in range(2) for rid in PROMPTS)
    print(f"tp2 vs tp1: largest logit difference {diff:.3g}, least top-2 margin {margin:.3g}")
    for rid in PROMPTS:
        np.testing.assert_array_equal(got[0][rid], got[1][rid])  # the collective adds in rank order everywhere
        assert np.argmax(got[0][rid], axis=1).tolist() == want[rid], rid
    assert diff < margin / 2, (diff, margin)

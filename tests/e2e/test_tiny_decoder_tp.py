"""tp=2 in two real worker processes gives the same tokens, and the same KV shards, as tp=1."""
from __future__ import annotations

import multiprocessing as mp
import queue

import numpy as np

from fastkv.config import KVLayout
from fastkv.engine.runners.tiny_decoder import TinyConfig, TinyDecoderRunner
from fastkv.ipc.collective import ShmCollective
from tests.conftest import shm_test_name
from tests.runner_driver import drive

CFG = TinyConfig(vocab=512, hidden=64, intermediate=128, max_positions=256, seed=11)
H, BLOCKS, SEED, MAX_NEW = 2, 96, 1234, 6  # kv heads per rank
PROMPTS = {i: [(i * 97 + j * 31) % CFG.vocab for j in range(3 + 5 * i)] for i in range(5)}


def layout(tp: int) -> KVLayout:
    return KVLayout(num_layers=2, kv_heads=H * 2 // tp, block_size=4, head_dim=16, dtype="float32", tp_size=tp)


def run(tp: int, rank: int, collective: ShmCollective | None):
    lay = layout(tp)
    k = [np.zeros(lay.device_shape(BLOCKS), np.float32) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(BLOCKS), np.float32) for _ in range(lay.num_layers)]
    runner = TinyDecoderRunner(lay, rank, tp, k, v, config=CFG, collective=collective)
    out, stats = drive(runner, PROMPTS, MAX_NEW, np.random.default_rng(SEED), max_chunk=5, preempt_prob=0.25)
    return out, stats.steps, stats.preemptions, k, v


def worker(name: str, rank: int, results) -> None:
    with ShmCollective.attach(name, rank, timeout_s=60) as c:
        results.put((rank, run(2, rank, c)))


def test_tp2_in_two_processes_equals_tp1():
    want_out, steps, preemptions, k1, v1 = run(1, 0, None)
    assert steps > 10 and preemptions > 0, "the schedule should batch, chunk and preempt"
    name = shm_test_name()
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    with ShmCollective.create(name, 2, slot_bytes=1 << 20):
        procs = [ctx.Process(target=worker, args=(name, r, results), daemon=True) for r in range(2)]
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
    for rank in range(2):
        out, steps_r, _, k, v = got[rank]
        assert out == want_out and steps_r == steps
        for layer in range(2):
            np.testing.assert_array_equal(k[layer], k1[layer][:, rank * H : (rank + 1) * H])
            np.testing.assert_array_equal(v[layer], v1[layer][:, rank * H : (rank + 1) * H])

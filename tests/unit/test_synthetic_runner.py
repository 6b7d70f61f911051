"""The synthetic runner: its bytes are checkable anywhere, and any corruption is named precisely."""
from __future__ import annotations

import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastkv.config import KVLayout
from fastkv.engine.runners.synthetic import (
    KVMismatch,
    SyntheticRunner,
    decode_rows,
    expected_block,
    kv_rows,
    kv_rows_reference,
    next_token,
    reference_output,
    verify_block,
    verify_seq,
    write_rows,
)
from fastkv.sched.output import SeqWork, StepPlan
from tests.runner_driver import drive

# These properties run whole schedules, so they get a fixed budget (4x in CI), not the profile's.
SCALE = 4 if os.environ.get("CI") else 1
DTYPES = ["float32", "bfloat16", "float16", "uint8", "int8"]


def layout(dtype="bfloat16", tp=1):
    return KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=16, dtype=dtype, tp_size=tp)


def make(lay=None, blocks=64, paddle_caches=False, **kw):
    lay = lay or layout()
    k = [np.zeros(lay.device_shape(blocks), lay.numpy_dtype) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(blocks), lay.numpy_dtype) for _ in range(lay.num_layers)]
    kc, vc = k, v
    if paddle_caches:
        import paddle

        kc = [paddle.utils.dlpack.from_dlpack(a.__dlpack__()) for a in k]
        vc = [paddle.utils.dlpack.from_dlpack(a.__dlpack__()) for a in v]
    return SyntheticRunner(lay, 0, lay.tp_size, kc, vc, **kw), k, v


@pytest.mark.parametrize("dtype", DTYPES)
def test_rows_name_their_token_and_position_and_are_finite(dtype):
    lay = layout(dtype)
    tok, pos = np.array([0, 1, 70000, 2**32 - 1]), np.array([5, 0, 123456, 7])
    rows = kv_rows(lay, 0, tok, pos)
    assert rows.shape == (2, 2, 2, 4, 16) and rows.dtype == lay.numpy_dtype
    got_tok, got_pos = decode_rows(lay, rows)
    assert got_tok.tolist() == tok.tolist() and got_pos.tolist() == pos.tolist()
    if dtype == "bfloat16":
        assert np.isfinite((rows.astype(np.uint32) << 16).view(np.float32)).all()
    elif dtype.startswith("float"):
        assert np.isfinite(rows).all()
    # Every (layer, K|V, head) row differs: a block copied to the wrong layer or head is caught.
    flat = rows[..., 8:].reshape(8, 4, -1)
    assert len({flat[i, 0].tobytes() for i in range(8)}) == 8


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=25)
@given(data=st.data())
def test_compiled_rows_equal_the_numpy_definition(dtype, data):
    """fastkv.native._synthetic makes the rows; kv_rows_reference defines their bytes."""
    lay = KVLayout(num_layers=data.draw(st.integers(1, 3)), kv_heads=data.draw(st.integers(1, 3)), block_size=4,
                   head_dim=data.draw(st.sampled_from([9, 16, 24, 64])), dtype=dtype)
    n = data.draw(st.integers(0, 40))
    tok = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)), dtype=np.int64)
    pos = np.array(data.draw(st.lists(st.integers(0, (1 << 24) - 1), min_size=n, max_size=n)), dtype=np.int64)
    rank, version = data.draw(st.integers(0, 3)), data.draw(st.sampled_from(["0", "1", "v2"]))
    got, want = kv_rows(lay, rank, tok, pos, version), kv_rows_reference(lay, rank, tok, pos, version)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20)
@given(data=st.data())
def test_rows_written_into_the_caches_equal_the_numpy_scatter(dtype, data):
    lay = KVLayout(num_layers=data.draw(st.integers(1, 3)), kv_heads=data.draw(st.integers(1, 3)),
                   block_size=data.draw(st.integers(1, 4)), head_dim=data.draw(st.sampled_from([9, 16, 24])),
                   dtype=dtype)
    nb = 6
    slots_all = data.draw(st.permutations(range(nb * lay.block_size)))
    n = data.draw(st.integers(0, len(slots_all)))
    where = np.array(slots_all[:n], np.int64)  # distinct slots, as a step writes them
    tok = np.array(data.draw(st.lists(st.integers(0, 2**32 - 1), min_size=n, max_size=n)), np.int64)
    pos = np.array(data.draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n)), np.int64)
    rank = data.draw(st.integers(0, 2))
    got = [np.full(lay.device_shape(nb), 7, lay.numpy_dtype) for _ in range(2 * lay.num_layers)]
    want = [c.copy() for c in got]
    write_rows(lay, rank, got, tok, pos, where // lay.block_size, where % lay.block_size, "w")
    rows = kv_rows_reference(lay, rank, tok, pos, "w")
    for layer in range(lay.num_layers):
        for kv in range(2):
            want[2 * layer + kv][where // lay.block_size, :, where % lay.block_size, :] = \
                rows[layer, kv].transpose(1, 0, 2)
    for g, w in zip(got, want, strict=True):
        assert g.tobytes() == w.tobytes()  # written where asked, untouched elsewhere


def test_rows_into_the_caches_refuse_bad_ids_and_caches():
    lay = layout()
    caches = [np.zeros(lay.device_shape(3), lay.numpy_dtype) for _ in range(2 * lay.num_layers)]
    tok, pos = np.array([1, 2]), np.array([0, 1])
    for blocks, slots in (([0, 3], [0, 1]), ([0, -1], [0, 1]), ([0, 1], [0, lay.block_size])):
        with pytest.raises(ValueError, match="outside 3 blocks of 4 slots"):
            write_rows(lay, 0, caches, tok, pos, np.array(blocks), np.array(slots))
    assert not any(c.any() for c in caches), "nothing written when any id is bad"
    with pytest.raises(ValueError, match="sizes disagree"):
        write_rows(lay, 0, caches[:3], tok, pos, np.array([0, 1]), np.array([0, 1]))
    with pytest.raises(ValueError, match="cache 1 holds"):
        write_rows(lay, 0, [caches[0], np.zeros(lay.device_shape(2), lay.numpy_dtype), *caches[2:]], tok, pos,
                   np.array([0, 1]), np.array([0, 1]))


def test_compiled_rows_refuse_buffers_that_disagree():
    from fastkv.native import _synthetic

    keys, salts = np.zeros(3, np.uint64), np.zeros((2, 8), np.uint64)  # 3 tokens; 1 layer, K and V, 1 head
    header = np.zeros((3, 8), np.uint16)
    where = np.zeros(3, np.int64), np.arange(3, dtype=np.int64)  # block 0, slots 0-2

    def scatter(caches, hdr=header, kind=1):
        _synthetic.scatter_rows(caches, *where, keys, salts, hdr, kind, 16, 3)

    scatter([np.empty((1, 1, 3, 16), np.uint16) for _ in range(2)])  # sizes agree
    with pytest.raises(ValueError, match="sizes disagree"):
        scatter([np.empty((1, 1, 3, 16), np.uint16) for _ in range(2)], hdr=np.zeros((2, 8), np.uint16))
    with pytest.raises(ValueError, match="bad kind"):
        scatter([np.empty((1, 1, 3, 16), np.uint16) for _ in range(2)], kind=7)
    read_only = np.empty((1, 1, 3, 16), np.uint16)
    read_only.setflags(write=False)
    for out in (read_only, np.empty((1, 1, 6, 16), np.uint16)[:, :, ::2]):
        with pytest.raises(TypeError, match="C-contiguous writable"):
            scatter([np.empty((1, 1, 3, 16), np.uint16), out])


def test_rank_shards_are_heads_of_the_tp1_layout():
    tok, pos = np.arange(5), np.arange(5)
    full = kv_rows(KVLayout(2, 4, 4, 16, "float32"), 0, tok, pos)
    for r in range(2):
        shard = kv_rows(KVLayout(2, 2, 4, 16, "float32", tp_size=2), r, tok, pos)
        np.testing.assert_array_equal(shard, full[:, :, 2 * r : 2 * r + 2])


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=20 * SCALE)
@given(data=st.data())
def test_verify_block_detects_any_flipped_byte(dtype, data):
    lay = layout(dtype)
    n = data.draw(st.integers(1, lay.block_size))
    tokens = np.array(data.draw(st.lists(st.integers(0, 5000), min_size=n, max_size=n)))
    block = expected_block(lay, 1, tokens, 8)
    assert verify_block(lay, 1, block, 8, n, tokens).tolist() == tokens.tolist()
    raw = block.view(np.uint8).reshape(lay.num_layers, 2, lay.kv_heads, lay.block_size, -1)
    layer, kv, head = (data.draw(st.integers(0, s - 1)) for s in raw.shape[:3])
    slot = data.draw(st.integers(0, n - 1))
    byte = data.draw(st.integers(0, raw.shape[-1] - 1))
    raw[layer, kv, head, slot, byte] ^= np.uint8(1 << data.draw(st.integers(0, 7)))
    with pytest.raises(KVMismatch, match=f"position {8 + slot} "):
        verify_block(lay, 1, block, 8, n, tokens)


def test_verify_block_catches_wrong_tokens_position_and_rank():
    lay = layout()
    block = expected_block(lay, 0, np.array([1, 2, 3]), 4)
    assert not block[:, :, :, 3:].any(), "slots past the tokens are zero"
    with pytest.raises(KVMismatch, match="expected token 9"):
        verify_block(lay, 0, block, 4, 3, [1, 9, 3])
    with pytest.raises(KVMismatch, match="position 8"):
        verify_block(lay, 0, block, 8, 3)  # the right tokens at the wrong place
    with pytest.raises(KVMismatch):
        verify_block(lay, 1, block, 4, 3)  # another rank's shard
    with pytest.raises(KVMismatch, match="position 7"):
        verify_block(lay, 0, block, 4, 4)  # a slot never written
    verify_block(lay, 0, block.tobytes(), 4, 3)  # raw bytes are accepted


@pytest.mark.parametrize("paddle_caches", [False, True])
def test_step_writes_in_place_expected_bytes_and_samples_the_synthetic_token(paddle_caches):
    runner, k, v = make(paddle_caches=paddle_caches)
    table = np.array([17, 3])
    out = runner.step(StepPlan(3, [SeqWork(5, np.array([10, 11, 12, 13, 14, 15]), 0, table, True)]))
    assert out.step_id == 3 and out.sampled == {5: next_token([10, 11, 12, 13, 14, 15], 1024, "bfloat16")}
    lay = runner.layout
    for b, (blk, toks) in enumerate([(17, [10, 11, 12, 13]), (3, [14, 15])]):
        want = expected_block(lay, 0, np.array(toks), 4 * b)
        for layer in range(lay.num_layers):
            np.testing.assert_array_equal(k[layer][blk, :, : len(toks)], want[layer, 0, :, : len(toks)])
            np.testing.assert_array_equal(v[layer][blk, :, : len(toks)], want[layer, 1, :, : len(toks)])
    untouched = np.ones(64, bool)
    untouched[[17, 3]] = False
    assert not any(a[untouched].any() or a[3, :, 2:].any() for a in k + v), "a write strayed outside the slots"


@settings(max_examples=15 * SCALE)
@given(seed=st.integers(0, 2**32 - 1), dtype=st.sampled_from(DTYPES))
def test_runner_only_writes_new_slots_and_verifies_everything_under_a_random_schedule(seed, dtype):
    runner, k, v = make(layout(dtype), blocks=80)
    rng = np.random.default_rng(seed)
    prompts = {rid: rng.integers(0, 1000, int(rng.integers(1, 15))).tolist() for rid in range(4)}
    bs = runner.layout.block_size

    def check(step_id, seqs):
        allowed = {(int(s.block_table[p // bs]), p % bs) for s in seqs for p in range(s.start_pos, s.end_pos)}
        for a, b0 in zip(k + v, check.before, strict=True):
            changed = {(int(b), int(s)) for b, s in zip(*np.nonzero((a != b0).any(axis=(1, 3))), strict=True)}
            assert changed <= allowed, f"step {step_id} wrote outside its slots: {sorted(changed - allowed)}"
        check.before = [a.copy() for a in k + v]

    check.before = [a.copy() for a in k + v]
    got, stats = drive(runner, prompts, 4, rng, max_chunk=5, preempt_prob=0.3, on_step=check)
    for rid, p in prompts.items():  # the synthetic model: next token from the whole context
        assert got[rid] == reference_output(p, 4, 1024, dtype)


def test_corruption_in_the_device_cache_is_caught_before_the_next_step():
    runner, k, v = make()
    table = np.array([8, 9])
    out = runner.step(StepPlan(0, [SeqWork(1, np.arange(6), 0, table, True)]))
    v[1][9, 1, 1, 7] ^= 0x40  # position 5, layer 1, V, head 1
    with pytest.raises(KVMismatch, match=r"request 1: block 9 position 5 .*layer 1 V head 1"):
        runner.step(StepPlan(1, [SeqWork(1, np.array([out.sampled[1]]), 6, table, True)]))
    with pytest.raises(KVMismatch, match="request 4: block 9 position 5"):
        verify_seq(runner.layout, 0, k, v, 4, table, 6)


def test_a_restored_request_must_get_its_own_tokens_back():
    runner, k, v = make()
    runner.step(StepPlan(0, [SeqWork(1, np.arange(8), 0, np.array([0, 1]), True)]))
    runner.step(StepPlan(1, [SeqWork(2, np.arange(100, 108), 0, np.array([2, 3]), True)]))
    # Restored into the other request's blocks: self-consistent bytes, wrong tokens.
    with pytest.raises(KVMismatch, match="request 1: block 2 position 0 holds token 100"):
        runner.step(StepPlan(2, [SeqWork(1, np.array([5]), 8, np.array([2, 3, 4]), True)]))


def test_recompute_must_replay_the_same_tokens_and_a_prefix_hit_is_learned():
    runner, _, _ = make()
    runner.step(StepPlan(0, [SeqWork(1, np.arange(8), 0, np.array([0, 1]), True)]))
    with pytest.raises(KVMismatch, match="position 5 is fed token 99"):
        runner.step(StepPlan(1, [SeqWork(1, np.array([4, 99, 6]), 4, np.array([0, 7]), False)]))
    # A new request hitting request 1's first block: the runner learns its tokens from the cache.
    runner.step(StepPlan(2, [SeqWork(2, np.array([4, 5]), 4, np.array([0, 11]), False)]))
    with pytest.raises(KVMismatch, match="request 2: position 1 is fed token 7"):
        runner.step(StepPlan(3, [SeqWork(2, np.array([7]), 1, np.array([0, 11]), False)]))


def test_verify_resumed_skips_running_sequences_but_checks_resumed_ones():
    runner, k, _ = make(verify="resumed")
    table = np.array([0, 1])
    runner.step(StepPlan(0, [SeqWork(1, np.arange(3), 0, table, True)]))
    k[0][0, 0, 0, 9] ^= 1
    runner.step(StepPlan(1, [SeqWork(1, np.array([3]), 3, table, True)]))  # still running: not checked
    runner.step(StepPlan(2, [SeqWork(2, np.array([3]), 0, np.array([5]), True)]))
    with pytest.raises(KVMismatch, match="request 1: block 0 position 0"):
        runner.step(StepPlan(3, [SeqWork(1, np.array([4]), 4, table, True)]))  # missed a step: resumed
    off, k, _ = make(verify="off")
    off.step(StepPlan(0, [SeqWork(1, np.arange(3), 0, table, True)]))
    k[0][0, 0, 0, 9] ^= 1
    off.step(StepPlan(1, [SeqWork(1, np.array([3]), 5, np.array([0, 1, 2]), True)]))


def test_release_forgets_and_history_is_bounded():
    runner, _, _ = make(max_tracked_requests=2)
    for rid in range(4):
        runner.step(StepPlan(rid, [SeqWork(rid, np.array([1]), 0, np.array([rid]), True)]))
    assert list(runner._history) == [2, 3]
    runner.release([3, 99])
    assert list(runner._history) == [2]


def test_simulated_compute_burns_at_least_the_configured_time():
    runner, _, _ = make(compute_us_per_token=2000.0, step_us=1000.0)
    out = runner.step(StepPlan(0, [SeqWork(1, np.arange(5), 0, np.array([0, 1]), True)]))
    assert out.seconds >= 0.011


def test_bad_plans_and_layouts_are_rejected():
    runner, _, _ = make(blocks=8)
    bad = [
        (SeqWork(1, np.arange(5), 0, np.array([0]), True), "needs 2 blocks"),
        (SeqWork(1, np.arange(2), 0, np.array([8]), True), "outside"),
        (SeqWork(1, np.arange(6), 0, np.array([3, 3]), True), "repeats"),
        (SeqWork(1, np.array([], np.int32), 0, np.array([0]), True), "no new tokens"),
        (SeqWork(1, np.array([-1]), 0, np.array([0]), True), "negative token"),
    ]
    for seq, msg in bad:
        with pytest.raises(ValueError, match=msg):
            runner.step(StepPlan(0, [seq]))
    with pytest.raises(ValueError, match="same KV slot"):
        runner.step(StepPlan(0, [SeqWork(1, [1], 0, [2], True), SeqWork(2, [1, 2], 0, [2], True)]))
    with pytest.raises(ValueError, match="twice"):
        runner.step(StepPlan(0, [SeqWork(1, [1], 0, [2], True), SeqWork(1, [1], 1, [2], True)]))
    with pytest.raises(TypeError, match="StepPlan"):
        runner.step([])
    lay = layout()
    k = [np.zeros(lay.device_shape(4), np.float32)] * 2
    with pytest.raises(ValueError, match="dtype float32, layout says bfloat16"):
        SyntheticRunner(lay, 0, 1, k, k)
    with pytest.raises(ValueError, match="tp_size 2 disagrees"):
        SyntheticRunner(lay, 0, 2, k, k)
    with pytest.raises(ValueError, match="one per layer"):
        SyntheticRunner(lay, 0, 1, k[:1], k[:1])
    with pytest.raises(ValueError, match="head_dim"):
        kv_rows(KVLayout(1, 1, 4, 8), 0, [1], [1])


def test_runner_registry_and_synthetic_needs_no_paddle():
    import subprocess
    import sys

    from fastkv.engine.runners import runner_class

    assert runner_class("synthetic") is SyntheticRunner
    with pytest.raises(ValueError, match="unknown runner"):
        runner_class("gpt5")
    code = "import sys, fastkv.engine.runners.synthetic; assert 'paddle' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_bfloat16_paddle_caches_from_the_tiers_are_written_in_place():
    """The device tier hands runners bfloat16 Paddle tensors over shm (fastkv.transfer.tiers);
    numpy has no bfloat16, so host_view must reinterpret their bits, not reject them."""
    from fastkv.transfer.tiers import numpy_to_paddle

    lay = layout("bfloat16")
    k = [np.zeros(lay.device_shape(8), np.uint16) for _ in range(lay.num_layers)]
    v = [np.zeros(lay.device_shape(8), np.uint16) for _ in range(lay.num_layers)]
    runner = SyntheticRunner(lay, 0, 1, [numpy_to_paddle(a, "bfloat16") for a in k],
                             [numpy_to_paddle(a, "bfloat16") for a in v])
    runner.step(StepPlan(1, [SeqWork(7, np.array([3, 4, 5]), 0, np.array([2]), True)]))
    want = expected_block(lay, 0, np.array([3, 4, 5]), 0)
    for layer in range(lay.num_layers):
        np.testing.assert_array_equal(k[layer][2, :, :3], want[layer, 0, :, :3])
        np.testing.assert_array_equal(v[layer][2, :, :3], want[layer, 1, :, :3])

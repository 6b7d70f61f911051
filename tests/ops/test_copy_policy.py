"""The measured copy policy (regular or streaming stores, threads, by call size) and the bound
C ABI swap the transfer hot path uses."""
from __future__ import annotations

import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastkv.config import KVLayout
from fastkv.kernels import ops
from tests.ops.conftest import Tiers

MIB = 1 << 20


@pytest.fixture
def policy(paddle_ops):
    """Lets a test install its own policy; the machine's comes back afterwards."""
    yield ops.set_copy_policy
    ops.set_copy_policy(ops.cached_copy_policy())


def test_choose_policy_takes_the_fastest_choice_per_size():
    seconds = {
        (64 << 10, False, 1): 1.0, (64 << 10, True, 1): 2.0, (64 << 10, False, 2): 3.0, (64 << 10, True, 2): 4.0,
        (MIB, False, 1): 2.0, (MIB, True, 1): 3.0, (MIB, False, 2): 5.0, (MIB, True, 2): 4.0,
        (16 * MIB, False, 1): 9.0, (16 * MIB, True, 1): 7.0, (16 * MIB, False, 2): 8.0, (16 * MIB, True, 2): 6.0,
    }
    # 64 KiB and 1 MiB agree (regular, 1 thread): one entry from 0; 16 MiB streams on 2 threads.
    assert ops.choose_policy(seconds) == [(0, False, 1), (16 * MIB, True, 2)]
    seconds[(MIB, True, 1)] = 1.0
    assert ops.choose_policy(seconds) == [(0, False, 1), (MIB, True, 1), (16 * MIB, True, 2)]


def test_swaps_follow_the_installed_policy(policy):
    policy([(0, False, 1), (MIB, True, 2), (8 * MIB, False, 4)])
    assert ops.copy_choice(512 << 10, 8) == (False, 1)
    assert ops.copy_choice(MIB, 8) == (True, 2)
    assert ops.copy_choice(4 * MIB, 1) == (True, 1)  # the caller's thread cap wins
    assert ops.copy_choice(64 * MIB, 8) == (False, 4)
    with pytest.raises(ValueError, match="not ascending"):
        policy([(0, False, 1), (0, True, 1)])


def test_the_policy_is_measured_once_per_machine_and_cached_with_the_build(paddle_ops, tmp_path, monkeypatch):
    monkeypatch.setenv("FASTKV_OPS_CACHE", str(tmp_path))
    measured = {(64 << 10, False, 1): 2.0, (64 << 10, True, 1): 1.0}
    calls = []
    monkeypatch.setattr(ops, "measure_copy_methods", lambda: calls.append(1) or measured)
    assert ops.cached_copy_policy() == [(0, True, 1)]
    assert ops.cached_copy_policy() == [(0, True, 1)] and len(calls) == 1  # the second load reads the file
    (saved,) = tmp_path.glob(f"*/{ops.POLICY_FILE}")
    assert saved.parent.name == ops.build_tag()
    monkeypatch.setattr(ops, "_machine_id", lambda: "another machine")
    measured[(64 << 10, False, 1)] = 0.5
    assert ops.cached_copy_policy() == [(0, False, 1)] and len(calls) == 2  # another CPU measures again


def test_measurement_times_every_choice_at_every_size(paddle_ops):
    seconds = ops.measure_copy_methods(max_threads=2, sizes=(64 << 10, MIB))
    assert set(seconds) == {(s, m, t) for s in (64 << 10, MIB) for m in (False, True) for t in (1, 2)}
    assert all(0 < t < 1 for t in seconds.values())


@settings(max_examples=30, deadline=None)
@given(st.booleans(), st.booleans(), st.integers(1, 3), st.integers(0, 2**32 - 1))
def test_bound_swap_matches_the_reference_with_either_stores(paddle_ops, streaming, to_host, threads, seed):
    ops.set_copy_policy([(0, streaming, threads)])
    try:
        layout = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=40, dtype="bfloat16")
        rng = np.random.default_rng(seed)
        tiers = Tiers(layout, 9, 7, rng)
        n_src, n_dst = (9, 7) if to_host else (7, 9)
        dst = rng.permutation(n_dst)[: rng.integers(0, n_dst + 1)].astype(np.int32)
        src = rng.integers(0, n_src, len(dst)).astype(np.int32)
        expected = tiers.snapshot()
        ops.swap_blocks_ref(expected[:2], expected[2:4], expected[4], src, dst, to_host=to_host)
        ops.BoundSwap(tiers.k_t, tiers.v_t, tiers.host_t).swap(src, dst, to_host=to_host, num_threads=threads)
        tiers.assert_bytes_equal(expected)
    finally:
        ops.set_copy_policy(ops.cached_copy_policy())


def test_one_bound_swap_serves_calls_of_every_size(paddle_ops):
    # It copies each call's ids into buffers of its own: a short call after a long one, a
    # call with more ids than a tier has blocks (repeated src ids), and other id dtypes.
    layout = KVLayout(num_layers=2, kv_heads=1, block_size=2, head_dim=8, dtype="float32")
    rng = np.random.default_rng(3)
    tiers = Tiers(layout, 3, 5, rng)
    bound = ops.BoundSwap(tiers.k_t, tiers.v_t, tiers.host_t)
    calls = [([0, 1, 2], [4, 0, 3], True), ([2], [1], True), ([4, 1], [0, 2], False), ([], [], True),
             ([1] * 5, [0, 1, 2, 3, 4], True), (np.array([3, 0], np.int64), np.array([2, 1], np.uint8), False)]
    for src, dst, to_host in calls:
        expected = tiers.snapshot()
        ops.swap_blocks_ref(expected[:2], expected[2:4], expected[4], src, dst, to_host=to_host)
        bound.swap(src, dst, to_host=to_host, num_threads=1)
        tiers.assert_bytes_equal(expected)
    with pytest.raises(ValueError, match="src id 7 at position 5 is out of range"):
        bound.swap([0] * 5 + [7], [0, 1, 2, 3, 4, 0], to_host=True)


def test_bound_swap_refuses_bad_ids_before_anything_moves(paddle_ops):
    layout = KVLayout(num_layers=1, kv_heads=1, block_size=2, head_dim=8, dtype="float32")
    tiers = Tiers(layout, 4, 3, np.random.default_rng(0))
    bound = ops.BoundSwap(tiers.k_t, tiers.v_t, tiers.host_t)
    before = tiers.snapshot()
    with pytest.raises(ValueError, match="dst id 3 at position 1 is out of range"):
        bound.swap(np.array([0, 1], np.int32), np.array([0, 3], np.int32), to_host=True)
    with pytest.raises(ValueError, match="appears twice"):
        bound.swap([0, 1], [2, 2], to_host=False)
    with pytest.raises(ValueError, match="2 src ids but 1 dst ids"):
        bound.swap([0, 1], [2], to_host=False)
    tiers.assert_bytes_equal(before)


def test_bound_swap_checks_the_tensors_once_with_the_op(paddle_ops):
    layout = KVLayout(num_layers=2, kv_heads=1, block_size=2, head_dim=8, dtype="float32")
    tiers = Tiers(layout, 4, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match="V\\[1\\] has shape"):
        ops.BoundSwap(tiers.k_t, [tiers.v_t[0], tiers.k_t[0][:2]], tiers.host_t)


def test_bound_swap_skips_the_op_dispatch(paddle_ops):
    # The per-call cost a small task pays: best of many, so a loaded machine cannot fake it.
    layout = KVLayout(num_layers=2, kv_heads=1, block_size=2, head_dim=8, dtype="float32")
    tiers = Tiers(layout, 4, 3, np.random.default_rng(0))
    bound = ops.BoundSwap(tiers.k_t, tiers.v_t, tiers.host_t)
    src, dst = np.array([1], np.int32), np.array([2], np.int32)

    def best(fn) -> float:
        times = []
        for _ in range(200):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    op = best(lambda: ops.swap_out(tiers.k_t, tiers.v_t, tiers.host_t, src, dst, num_threads=1))
    direct = best(lambda: bound.swap(src, dst, to_host=True, num_threads=1))
    assert direct * 3 < op, f"bound swap {direct * 1e6:.1f} us, op {op * 1e6:.1f} us"

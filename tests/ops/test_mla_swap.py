"""MLA tiers through the swap op: no V tensors, one latent page per layer, host blocks
[layers, 1, 1, block_size, latent_dim]; the op, the bound swap (C ABI) and the checksums
against their references."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.kernels import ops
from fastkv.transfer.tiers import block_checksum
from tests.ops.conftest import Tiers

pytestmark = pytest.mark.usefixtures("paddle_ops")

LAYOUTS = [
    KVLayout(num_layers=3, kv_heads=1, block_size=4, head_dim=72, dtype="bfloat16", mla=True),
    KVLayout(num_layers=1, kv_heads=1, block_size=3, head_dim=5, dtype="float32", mla=True),
    # 1 MiB pages: the streaming path, split over threads
    KVLayout(num_layers=2, kv_heads=1, block_size=512, head_dim=1024, dtype="float16", mla=True),
]


def _case(layout: KVLayout, to_host: bool, seed: int):
    rng = np.random.default_rng(seed)
    tiers = Tiers(layout, 9, 7, rng)
    num_src, num_dst = (9, 7) if to_host else (7, 9)
    dst = rng.permutation(num_dst)[:5]
    src = rng.integers(0, num_src, 5)
    expected = tiers.snapshot()
    ops.swap_blocks_ref(expected[: layout.num_layers], [], expected[-1], src, dst, to_host=to_host)
    return tiers, src, dst, expected


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda lay: f"L{lay.num_layers}-{lay.head_dim}")
@pytest.mark.parametrize("to_host", [True, False])
@pytest.mark.parametrize("threads", [1, 3])
def test_an_mla_swap_moves_each_latent_page_to_its_place(layout, to_host, threads):
    assert layout.host_shape(7) == (7, layout.num_layers, 1, 1, layout.block_size, layout.head_dim)
    tiers, src, dst, expected = _case(layout, to_host, threads + layout.num_layers)
    assert tiers.v == []
    ops.swap_blocks(tiers.k_t, [], tiers.host_t, src, dst, to_host=to_host, num_threads=threads)
    tiers.assert_bytes_equal(expected)


@pytest.mark.parametrize("layout", LAYOUTS[:2], ids=lambda lay: f"L{lay.num_layers}-{lay.head_dim}")
def test_a_bound_mla_swap_out_copies_and_seals_each_block(layout):
    tiers, src, dst, expected = _case(layout, True, 5)
    sums = np.zeros((7, 16), np.uint8)
    bound = ops.BoundSwap(tiers.k_t, [], tiers.host_t)
    assert bound.swap(src, dst, to_host=True, sums=sums)
    tiers.assert_bytes_equal(expected)
    for b in dst:
        assert sums[b].tobytes() == block_checksum(tiers.host[b])
    assert [r.tobytes() for r in ops.block_checksums(tiers.host, dst)] == [block_checksum(tiers.host[b]) for b in dst]


def test_one_flipped_byte_in_any_latent_page_changes_its_checksum():
    layout = LAYOUTS[0]
    host = np.zeros(layout.host_shape(1), layout.numpy_dtype)
    clean = ops.block_checksums(host, [0])[0].tobytes()
    for layer in range(layout.num_layers):
        host.view(np.uint8)[0, layer, 0, 0, -1, -1] ^= 1
        assert ops.block_checksums(host, [0])[0].tobytes() != clean, layer
        host.view(np.uint8)[0, layer, 0, 0, -1, -1] ^= 1


def test_an_mla_host_tier_must_have_one_page_per_layer(paddle_ops):
    layout = LAYOUTS[1]
    tiers = Tiers(layout, 3, 3, np.random.default_rng(0))
    two = Tiers(KVLayout(1, 1, 3, 5, "float32"), 3, 3, np.random.default_rng(0))
    with pytest.raises(ValueError, match=r"Host shape \[3, 1, 2, 1, 3, 5\] does not match.*\[blocks, 1, 1, 1, 3, 5\]"):
        ops.swap_blocks(tiers.k_t, [], two.host_t, [0], [0], to_host=True)

"""A hybrid's swaps in the task executor: a group's SWAP (``CopyPlan.group``) moves that group's
layers only, between its device tensors and its own host segment (``fastkv.transfer.group_swaps``),
with ids in that group's pools, checksums per segment, and the all-full path untouched."""
from __future__ import annotations

import uuid

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.config import KVLayout
from fastkv.ipc.namespace import SHM_DIR
from fastkv.run import RunSpec
from fastkv.transfer.executor import TaskExecutor
from fastkv.transfer.protocol import task_msg
from fastkv.transfer.tiers import DeviceTier, HostTier
from tests.optional import require_paddle

require_paddle()

LAYOUT = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=16, dtype="bfloat16", windows=(6, 0) * 2)


@pytest.fixture
def tiers(tmp_path):
    spec = RunSpec("t" + uuid.uuid4().hex[:8], LAYOUT, num_device_blocks=10, num_host_blocks=8,
                   group_blocks=(6, 10), runner="synthetic", out_dir=str(tmp_path))
    dev = DeviceTier.create(spec.tier_prefix, 0, LAYOUT, 10, backend="shm", layer_blocks=spec.layer_blocks())
    hosts = [HostTier.create(spec.tier_prefix, 0, lay, n, group=g) for g, lay, n in spec.host_tiers()]
    ex = None
    try:
        ex = TaskExecutor(spec, 0)
        yield spec, dev, hosts, ex
    finally:
        if ex is not None:
            ex.close()
        for t in [dev, *hosts]:
            t.unlink()
            t.close()
        assert not [p for p in SHM_DIR.iterdir() if p.name.startswith(spec.tier_prefix)]


def run(ex, kind, src, dst, group):
    return ex.run(task_msg(CopyPlan(int(uuid.uuid4().int % 2**31), kind, src, dst, group=group)))


def test_a_groups_swap_moves_its_layers_only_through_its_own_segment(tiers):
    spec, dev, hosts, ex = tiers
    assert spec.host_group_blocks() == (4, 8) and [h.array.shape[:2] for h in hosts] == [(4, 2), (8, 2)]
    rng = np.random.default_rng(0)
    for a in [*dev.k_arrays, *dev.v_arrays]:
        a[...] = rng.integers(0, 2**16, a.shape, dtype=np.uint16)
    before = [a.copy() for a in [*dev.k_arrays, *dev.v_arrays]]
    full = LAYOUT.groups[1].layers  # (1, 3)
    done = run(ex, CopyKind.SWAP_OUT, [9, 3], [6, 0], group=1)  # block 9 exists in the full group only
    assert done.ok, done.error
    assert done.nbytes == 2 * hosts[1].layout.block_bytes
    for j, layer in enumerate(full):
        assert (hosts[1].array[6, j, 0] == before[layer][9]).all()
        assert (hosts[1].array[0, j, 1] == before[4 + layer][3]).all()
    assert not hosts[0].array.any(), "another group's segment was written"
    for a in [*dev.k_arrays, *dev.v_arrays]:
        a[...] = 0
    done = run(ex, CopyKind.SWAP_IN, [6, 0], [2, 7], group=1)
    assert done.ok, done.error
    for layer in full:
        assert (dev.k_arrays[layer][2] == before[layer][9]).all()
        assert (dev.v_arrays[layer][7] == before[4 + layer][3]).all()
    for layer in LAYOUT.groups[0].layers:
        assert not dev.k_arrays[layer].any() and not dev.v_arrays[layer].any(), "a sliding layer was written"


def test_ids_are_the_groups_and_changed_host_bytes_never_reach_the_device(tiers):
    spec, dev, hosts, ex = tiers
    done = run(ex, CopyKind.SWAP_OUT, [7], [0], group=0)  # the sliding group has 6 device blocks
    assert not done.ok and "group 0 src block id 7 out of range [0, 6)" in done.error
    done = run(ex, CopyKind.SWAP_OUT, [1], [4], group=0)  # and 4 host blocks
    assert not done.ok and "group 0 dst block id 4 out of range [0, 4)" in done.error
    assert not run(ex, CopyKind.SWAP_OUT, [1], [0], group=2).ok
    assert run(ex, CopyKind.SWAP_OUT, [1], [3], group=0).ok
    hosts[0].array[3, 1, 0, 0, 0, 0] ^= 1
    done = run(ex, CopyKind.SWAP_IN, [3], [1], group=0)
    assert not done.ok and "checksum mismatch" in done.error and ex.checksum_mismatches == 1

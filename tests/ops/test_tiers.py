"""Sharing the KV tiers of a rank: zero-copy across processes, byte-identical swaps, clean names."""
from __future__ import annotations

import multiprocessing as mp
import os
import signal
import stat
from pathlib import Path

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.transfer.tiers import DeviceTier, HostTier, device_tier_name, host_tier_name, paddle_to_numpy
from tests.conftest import shm_test_name

LAYOUT = KVLayout(num_layers=3, kv_heads=2, block_size=8, head_dim=16, dtype="bfloat16")
NUM_DEV, NUM_HOST = 10, 7
TIMEOUT = 60


@pytest.fixture
def prefix():
    name = shm_test_name() + "_"  # carries this session's pid: a session beside ours does not count it
    yield name
    # A failing test must not also fail the session's leak check for what it left.
    for entry in Path("/dev/shm").glob(name + "*"):
        entry.unlink()


def _fill(tier: DeviceTier, seed: int) -> None:
    rng = np.random.default_rng(seed)
    for a in (*tier.k_arrays, *tier.v_arrays):
        a[:] = rng.integers(0, 2**16, a.shape, dtype=np.uint16)


def _transfer_swap_out(prefix, device_ids, host_ids, marker_block, done):
    """Plays the transfer process: attaches both tiers, swaps out, writes through Paddle."""
    from fastkv.kernels import ops

    device = DeviceTier.attach(prefix, 0, LAYOUT, NUM_DEV)
    host = HostTier.attach(prefix, 0, LAYOUT, NUM_HOST, pin=False)
    assert device.k[0].data_ptr() == device.k_arrays[0].ctypes.data, "device tier tensor is not the shm mapping"
    assert host.tensor.data_ptr() == host.array.ctypes.data, "host tier tensor is not the shm mapping"
    ops.swap_out(device.k, device.v, host.tensor, device_ids, host_ids, num_threads=2)
    device.v[2][marker_block] = 3.0  # a Paddle write the worker must see
    done.put("ok")


def _transfer_swap_in_and_hang(prefix, host_ids, device_ids, done):
    from fastkv.kernels import ops

    device = DeviceTier.attach(prefix, 0, LAYOUT, NUM_DEV)
    host = HostTier.attach(prefix, 0, LAYOUT, NUM_HOST, pin=False)
    ops.swap_in(device.k, device.v, host.tensor, host_ids, device_ids, num_threads=1)
    done.put("ok")
    signal.pause()  # killed by the test while attached


def _run(target, *args) -> None:
    ctx = mp.get_context("spawn")
    done = ctx.Queue()
    proc = ctx.Process(target=target, args=(*args, done))
    proc.start()
    try:
        assert done.get(timeout=TIMEOUT) == "ok"
    finally:
        if target is _transfer_swap_in_and_hang:
            os.kill(proc.pid, signal.SIGKILL)
        proc.join(TIMEOUT)
    assert proc.exitcode in (0, -signal.SIGKILL), f"transfer process exited with {proc.exitcode}"


def test_tiers_are_shared_zero_copy_between_processes(paddle_ops, prefix):
    host = HostTier.create(prefix, 0, LAYOUT, NUM_HOST)  # the supervisor
    device = DeviceTier.create(prefix, 0, LAYOUT, NUM_DEV, backend="shm")  # the worker
    try:
        _fill(device, seed=1)
        device_ids, host_ids = [9, 0, 4, 5, 6], [6, 0, 1, 2, 3]
        _run(_transfer_swap_out, prefix, device_ids, host_ids, 8)
        for d, h in zip(device_ids, host_ids, strict=True):
            for layer in range(LAYOUT.num_layers):
                assert np.array_equal(host.array[h, layer, 0], device.k_arrays[layer][d])
                assert np.array_equal(host.array[h, layer, 1], device.v_arrays[layer][d])
        assert np.all(host.array[4:6] == 0), "blocks nobody swapped to changed"
        assert np.all(device.v_arrays[2][8] == 0x4040), "the worker does not see the transfer process's write"
        assert float(device.v[2][8].astype("float32").mean()) == 3.0
    finally:
        device.unlink()
        host.unlink()
    assert not list(Path("/dev/shm").glob(prefix + "*"))


def test_host_tier_outlives_a_killed_transfer_process(paddle_ops, prefix):
    host = HostTier.create(prefix, 0, LAYOUT, NUM_HOST)
    device = DeviceTier.create(prefix, 0, LAYOUT, NUM_DEV, backend="shm")
    try:
        _fill(device, seed=2)
        original = [a.copy() for a in (*device.k_arrays, *device.v_arrays)]
        _run(_transfer_swap_out, prefix, [1, 2, 3], [4, 5, 6], 0)
        saved = host.array.copy()
        # The next transfer process is SIGKILLed after its swap; the tiers must not notice.
        _run(_transfer_swap_in_and_hang, prefix, [4, 5, 6], [7, 8, 9])
        assert np.array_equal(host.array, saved)
        for i, a in enumerate((*device.k_arrays, *device.v_arrays)):
            assert np.array_equal(a[7:10], original[i][1:4]), f"tensor {i}: swap-in is not byte-identical"
        # A restarted transfer process re-attaches and sees the same bytes.
        again = HostTier.attach(prefix, 0, LAYOUT, NUM_HOST, pin=False)
        assert np.array_equal(again.array, saved)
        again.close()
    finally:
        device.unlink()
        host.unlink()


def test_bfloat16_tensors_view_the_shared_bytes(paddle_ops, prefix):
    device = DeviceTier.create(prefix, 1, LAYOUT, NUM_DEV, backend="shm")
    try:
        for tensors, arrays in ((device.k, device.k_arrays), (device.v, device.v_arrays)):
            for t, a in zip(tensors, arrays, strict=True):
                assert t.dtype == paddle_ops.bfloat16
                assert t.data_ptr() == a.ctypes.data
                assert list(t.shape) == list(LAYOUT.device_shape(NUM_DEV))
        device.k[1][2, 1, 3, 5] = 1.0
        assert device.k_arrays[1][2, 1, 3, 5] == 0x3F80  # bfloat16(1.0)
        assert paddle_to_numpy(device.k[1]).ctypes.data == device.k_arrays[1].ctypes.data
    finally:
        device.unlink()
        device.close()


def test_segments_are_private_and_named_by_prefix(prefix):
    host = HostTier.create(prefix, 3, LAYOUT, NUM_HOST)
    try:
        path = Path("/dev/shm") / host_tier_name(prefix, 3)
        assert path.exists() and host.name == f"{prefix}kvhost3"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert device_tier_name(prefix, 3) == f"{prefix}kvdev3"
        assert bytes(host.block_bytes(2)) == host.array[2].tobytes()
        assert len(host.block_bytes(0)) == LAYOUT.block_bytes
    finally:
        host.unlink()
        host.close()
    assert not path.exists()


def test_attach_checks_what_it_maps(prefix):
    host = HostTier.create(prefix, 0, LAYOUT, NUM_HOST)
    try:
        other = KVLayout(num_layers=3, kv_heads=2, block_size=8, head_dim=16, dtype="float16")
        with pytest.raises(ValueError, match="layout"):
            HostTier.attach(prefix, 0, other, NUM_HOST, pin=False)
        with pytest.raises(ValueError, match="bytes"):
            HostTier.attach(prefix, 0, LAYOUT, NUM_HOST + 1, pin=False)
        with pytest.raises(FileExistsError, match="exists already"):
            HostTier.create(prefix, 0, LAYOUT, NUM_HOST)
        with pytest.raises(FileNotFoundError):
            HostTier.attach(prefix, 1, LAYOUT, NUM_HOST, pin=False)
        with pytest.raises(ValueError, match="kind"):
            _attach_host_as_device(prefix)
        with pytest.raises(ValueError, match="block"):
            HostTier.block_bytes(host, NUM_HOST)
    finally:
        host.unlink()


def _attach_host_as_device(prefix):
    # A second name (hard link) for the host segment, under which a device attach finds it.
    src = Path("/dev/shm") / host_tier_name(prefix, 0)
    dst = Path("/dev/shm") / device_tier_name(prefix, 0)
    os.link(src, dst)
    try:
        DeviceTier.attach(prefix, 0, LAYOUT, NUM_HOST)
    finally:
        dst.unlink()


@pytest.mark.parametrize("bad", ["", "kv", "fkv/x", "fkv x", None])
def test_prefix_must_be_a_plain_fkv_name(bad):
    with pytest.raises(ValueError, match="prefix"):
        HostTier.create(bad, 0, LAYOUT, 1)


@pytest.mark.parametrize("blocks", [0, -1, 2.0, True])
def test_block_counts_are_checked(prefix, blocks):
    with pytest.raises(ValueError, match="num_blocks"):
        HostTier.create(prefix, 0, LAYOUT, blocks)


def test_release_gives_the_memory_back_and_every_mapping_reads_zeros(prefix):
    from fastkv.transfer.tiers import resident_bytes

    dev = DeviceTier.create(prefix, 0, LAYOUT, NUM_DEV, backend="shm")
    host = HostTier.create(prefix, 0, LAYOUT, NUM_HOST)
    try:
        _fill(dev, 1)
        host.array[:] = 7
        host.seal(range(NUM_HOST))
        other = DeviceTier.attach(prefix, 0, LAYOUT, NUM_DEV)  # another process's mapping, as the transfer's
        payload = 2 * LAYOUT.num_layers * NUM_DEV * LAYOUT.page_bytes
        held = resident_bytes(dev.name)
        assert held >= payload
        assert dev.release() == held
        assert resident_bytes(dev.name) < held - payload // 2, "the device tier's pages were not given back"
        assert not any(a.any() for a in (*other.k_arrays, *other.v_arrays)), "a mapping still sees the old KV"
        other.k_arrays[0][3] = 5  # written again: the pages come back
        assert dev.k_arrays[0][3].min() == 5
        before = resident_bytes(host.name)
        assert host.release() == before
        assert resident_bytes(host.name) < before - NUM_HOST * LAYOUT.block_bytes // 2
        assert not host.array.any() and host.corrupt(range(NUM_HOST)) == [], "released blocks must read as sealed zeros"
        other.close()
    finally:
        dev.close(), host.close()
        dev.unlink(), host.unlink()


def test_adopt_takes_the_deployments_own_caches(prefix):
    """A deployment that allocated its caches itself: on CPU their contents move into the shared tier."""
    rng = np.random.default_rng(4)
    shape = LAYOUT.device_shape(NUM_DEV)
    k = [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(LAYOUT.num_layers)]
    v = [rng.integers(0, 2**16, shape, dtype=np.uint16) for _ in range(LAYOUT.num_layers)]
    tier = DeviceTier.adopt(prefix, 0, LAYOUT, k, v)
    try:
        assert tier.num_blocks == NUM_DEV
        seen = DeviceTier.attach(prefix, 0, LAYOUT, NUM_DEV)  # what the transfer process maps
        for a, b in zip([*k, *v], [*seen.k_arrays, *seen.v_arrays], strict=True):
            assert np.array_equal(a, b)
        seen.close()
        with pytest.raises(ValueError, match="V cache of layer 1 has shape"):
            DeviceTier.adopt(prefix + "b", 0, LAYOUT, k, v[:1] + [v[1][:4]] + v[2:])
        with pytest.raises(ValueError, match="dtype float32"):
            DeviceTier.adopt(prefix + "c", 0, LAYOUT, [a.astype(np.float32) for a in k], v)
    finally:
        tier.close()
        tier.unlink()


def test_populated_tiers_are_resident_before_any_write(prefix):
    from fastkv.transfer.tiers import resident_bytes

    dev = DeviceTier.create(prefix, 0, LAYOUT, NUM_DEV, backend="shm", populate=True)
    host = HostTier.create(prefix, 0, LAYOUT, NUM_HOST, populate=True)
    lazy = HostTier.create(prefix, 1, LAYOUT, NUM_HOST)
    try:
        for tier in (dev, host):
            assert resident_bytes(tier.name) >= tier._segment.size, f"{tier.name}: pages left to first touch"
        assert resident_bytes(lazy.name) < NUM_HOST * LAYOUT.block_bytes // 2  # the test can tell them apart
        assert not host.array.any() and host.corrupt(range(NUM_HOST)) == []
    finally:
        for tier in (dev, host, lazy):
            tier.close()
            tier.unlink()


def test_a_tier_too_big_for_dev_shm_fails_at_once_and_leaves_nothing(prefix):
    too_many = os.statvfs("/dev/shm").f_blocks * os.statvfs("/dev/shm").f_frsize // LAYOUT.block_bytes + 16
    with pytest.raises(MemoryError, match=r"cannot allocate \d+ MiB in /dev/shm \(\d+ MiB free\)"):
        HostTier.create(prefix, 0, LAYOUT, too_many, populate=True)
    assert not list(Path("/dev/shm").glob(prefix + "*"))


def test_a_hybrids_groups_have_device_blocks_of_their_own(prefix):
    """A sliding-window hybrid's layers get their KV cache group's block count; the attaching
    process maps the same bytes, and a different split is refused by the segment's size."""
    lay = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=16, dtype="float32", windows=(8, 0) * 2)
    per_layer = lay.layer_blocks((3, 10), 10)
    assert per_layer == (3, 10, 3, 10)
    device = DeviceTier.create(prefix, 0, lay, 10, backend="shm", layer_blocks=per_layer)
    try:
        assert [k.shape[0] for k in device.k_arrays] == [3, 10, 3, 10] == [v.shape[0] for v in device.v_arrays]
        for i, (k, v) in enumerate(zip(device.k_arrays, device.v_arrays, strict=True)):
            k[...] = i + 1
            v[...] = -(i + 1)
        other = DeviceTier.attach(prefix, 0, lay, 10, layer_blocks=per_layer)
        try:
            for i, (k, v) in enumerate(zip(other.k_arrays, other.v_arrays, strict=True)):
                assert (k == i + 1).all() and (v == -(i + 1)).all(), f"layer {i} does not map the creator's bytes"
        finally:
            other.close()
        with pytest.raises(ValueError, match="bytes, expected"):
            DeviceTier.attach(prefix, 0, lay, 10)
    finally:
        device.close()
        device.unlink()
    assert not list(Path("/dev/shm").glob(prefix + "*"))

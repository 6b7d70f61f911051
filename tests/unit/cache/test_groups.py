"""Sizing a device tier per KV cache group, and the group core's refusals."""
import pytest

from fastkv.cache.groups import GroupedCache, split_device_tier
from fastkv.config import KVLayout

HYBRID = KVLayout(24, 8, 16, 64, windows=(128, 0) * 12)


def test_split_fits_the_bytes_and_sizes_the_sliding_group_by_its_bound():
    device = 30 * 10**9
    caps = split_device_tier(HYBRID, device, 34816, 2048, prefills=2)
    sliding, full = HYBRID.groups
    sizes = [HYBRID.group_block_bytes(g) for g in HYBRID.groups]
    used = sum(c * s for c, s in zip(caps, sizes, strict=True))
    assert device - sizes[1] < used <= device
    requests = caps[1] // (34816 // 16)  # the full group bounds how many requests of that length fit
    assert requests == 34  # twice what 30 GB hold of the all-full cache's 1.7 GB per request
    assert KVLayout(24, 8, 16, 64).block_bytes * (34816 // 16) * 17 < device < \
        KVLayout(24, 8, 16, 64).block_bytes * (34816 // 16) * 18
    # each request's decode bound, and two prefills' chunks on top
    assert caps[0] >= requests * sliding.max_blocks(16) + 2 * (sliding.max_blocks(16, 2048) - sliding.max_blocks(16))
    assert caps[0] < (requests + 1) * sliding.max_blocks(16) + 2 * sliding.max_blocks(16, 2048)


def test_all_full_layout_is_one_group():
    assert split_device_tier(KVLayout(4, 1, 16, 8), 2048 * 1000 + 5, 100, 16) == [1000]


@pytest.mark.parametrize("call,match", [
    (lambda c: c.allocate("a", [], 5, 4), "already allocated"),
    (lambda c: c.slots("a", 0, 5), r"a step over \[0, 5\)"),
    (lambda c: c.slots("a", 1, 1), r"a step over \[1, 2\)"),
    (lambda c: c.set_chunk("a", 8), "may only go down"),
    (lambda c: c.computed("a", 9, []), "outside"),
    (lambda c: c.free("b"), "unknown request 'b'"),
])
def test_bad_calls_are_refused_by_name(call, match):
    cache = GroupedCache(KVLayout(2, 1, 4, 8, windows=(4, 0)), [8, 8])
    cache.allocate("a", [], 5, 4)
    with pytest.raises(ValueError, match=match):
        call(cache)


def test_capacities_name_each_group():
    with pytest.raises(ValueError, match="each of the 2 groups"):
        GroupedCache(KVLayout(2, 1, 4, 8, windows=(4, 0)), [8])

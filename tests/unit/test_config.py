import numpy as np
import pytest

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.config import KVLayout


def test_layout_sizes():
    layout = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
    assert layout.page_bytes == 8 * 64 * 128 * 2
    assert layout.block_bytes == 8 * 2 * layout.page_bytes
    assert layout.host_shape(3) == (3, 8, 2, 8, 64, 128)
    assert layout.device_shape(5) == (5, 8, 64, 128)
    assert layout.numpy_dtype == np.uint16


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("kv_heads", -1), ("block_size", 1.5), ("head_dim", True)])
def test_layout_rejects_bad_sizes(field, value):
    kwargs = dict(num_layers=2, kv_heads=2, block_size=16, head_dim=64)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 16, 64, dtype="float64")


def test_plan_validates_lengths():
    plan = CopyPlan(1, CopyKind.SWAP_OUT, [1, 2], [3, 4])
    assert plan.src.dtype == np.int32 and plan.num_blocks == 2
    with pytest.raises(ValueError, match="as many src as dst"):
        CopyPlan(2, CopyKind.SWAP_IN, [1, 2], [3])
    with pytest.raises(ValueError, match="one key per"):
        CopyPlan(3, CopyKind.STORE, [1, 2], keys=(b"k",))

"""Every bad argument of ops.swap_blocks raises TypeError/ValueError naming it, and moves no byte."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.config import KVLayout
from fastkv.kernels import ops
from tests.ops.conftest import Tiers

LAYOUT = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16")
NUM_DEV, NUM_HOST = 6, 5
# Bad ids come last, after valid pairs: the checks must run before any copy.


def _other_dtype(paddle, t):
    return paddle.zeros(t.shape, dtype="float16")


# (name, how to break the call, exception, message fragment). Each mutator gets (paddle, tiers, kwargs).
CASES = [
    ("src out of range", lambda p, t, kw: kw.update(src=[0, 1, 2, NUM_DEV]), ValueError, "src id 6"),
    ("src negative", lambda p, t, kw: kw.update(src=[0, 1, 2, -1]), ValueError, "src id -1"),
    ("dst out of range", lambda p, t, kw: kw.update(dst=[0, 1, 2, NUM_HOST]), ValueError, "dst id 5"),
    ("dst negative", lambda p, t, kw: kw.update(dst=[0, 1, 2, -3]), ValueError, "dst id -3"),
    ("dst repeated", lambda p, t, kw: kw.update(dst=[0, 1, 2, 1]), ValueError, "appears twice"),
    ("dst repeated swapping in", lambda p, t, kw: kw.update(to_host=False, src=[0, 1, 2, 3], dst=[3, 3, 0, 1]),
     ValueError, "appears twice"),
    ("src out of range swapping in", lambda p, t, kw: kw.update(to_host=False, src=[0, 1, 2, NUM_HOST]), ValueError,
     "src id 5"),
    ("lengths differ", lambda p, t, kw: kw.update(dst=[0, 1]), ValueError, "4 src ids but 2 dst ids"),
    ("ids not integers", lambda p, t, kw: kw.update(src=np.array([0.0, 1.0, 2.0, 3.0])), TypeError, "integers"),
    ("ids 2-D", lambda p, t, kw: kw.update(src=np.zeros((2, 2), np.int32)), ValueError, "1-D"),
    ("id beyond int32", lambda p, t, kw: kw.update(src=np.array([2**32, 1, 2, 3])), ValueError, "4294967296"),
    ("fewer V than K", lambda p, t, kw: kw.update(v_caches=t.v_t[:1]), ValueError, "2 K tensors but 1 V"),
    ("no layers", lambda p, t, kw: kw.update(k_caches=[], v_caches=[]), ValueError, "at least one layer"),
    ("K shapes differ", lambda p, t, kw: kw.update(k_caches=[t.k_t[0], t.k_t[1][:5]]), ValueError, "K[1] has shape"),
    ("V dtype differs", lambda p, t, kw: kw.update(v_caches=[t.v_t[0], _other_dtype(p, t.v_t[1])]), ValueError,
     "V[1] has dtype"),
    ("host dtype differs", lambda p, t, kw: kw.update(host=_other_dtype(p, t.host_t)), ValueError, "Host has dtype"),
    ("host layers differ", lambda p, t, kw: kw.update(host=p.zeros([NUM_HOST, 3, 2, 2, 4, 8], "bfloat16")),
     ValueError, "does not match 2 layers"),
    ("host K/V axis not 2", lambda p, t, kw: kw.update(host=p.zeros([NUM_HOST, 2, 1, 2, 4, 8], "bfloat16")),
     ValueError, "does not match"),
    ("host head_dim differs", lambda p, t, kw: kw.update(host=p.zeros([NUM_HOST, 2, 2, 2, 4, 16], "bfloat16")),
     ValueError, "does not match"),
    ("host not 6-D", lambda p, t, kw: kw.update(host=p.zeros([NUM_HOST, 2, 2, 2, 32], "bfloat16")), ValueError,
     "Host must be"),
    ("device not 4-D", lambda p, t, kw: kw.update(k_caches=[x.reshape([NUM_DEV, 8, 8]) for x in t.k_t]),
     ValueError, "device tensors must be"),
    ("K strided view", lambda p, t, kw: kw.update(k_caches=[t.k_t[0], p.zeros([6, 2, 4, 16], "bfloat16")[..., :8]]),
     ValueError, "k_caches[1] must be contiguous"),
    ("host strided view", lambda p, t, kw: kw.update(host=p.zeros([NUM_HOST, 2, 2, 2, 4, 16], "bfloat16")[..., ::2]),
     ValueError, "host[0] must be contiguous"),
    ("K used twice", lambda p, t, kw: kw.update(k_caches=[t.k_t[0], t.k_t[0]]), ValueError, "overlap"),
    ("V aliases K", lambda p, t, kw: kw.update(v_caches=[t.v_t[0], t.k_t[1]]), ValueError, "overlap"),
    ("zero threads", lambda p, t, kw: kw.update(num_threads=0), ValueError, "num_threads"),
    ("negative threads", lambda p, t, kw: kw.update(num_threads=-2), ValueError, "num_threads"),
    ("threads not int", lambda p, t, kw: kw.update(num_threads=2.0), ValueError, "num_threads"),
    ("numpy array as K", lambda p, t, kw: kw.update(k_caches=[t.k[0], t.k_t[1]]), TypeError, "k_caches[0]"),
    ("host not a tensor", lambda p, t, kw: kw.update(host=t.host), TypeError, "host[0]"),
]


@pytest.mark.parametrize("name,mutate,exc,fragment", CASES, ids=[c[0] for c in CASES])
def test_bad_argument_raises_and_copies_nothing(paddle_ops, name, mutate, exc, fragment):
    tiers = Tiers(LAYOUT, NUM_DEV, NUM_HOST, np.random.default_rng(3))
    before = tiers.snapshot()
    kwargs = dict(k_caches=tiers.k_t, v_caches=tiers.v_t, host=tiers.host_t, src=[5, 0, 1, 2], dst=[0, 1, 2, 3],
                  to_host=True, num_threads=2)
    mutate(paddle_ops, tiers, kwargs)
    with pytest.raises(exc) as info:
        ops.swap_blocks(**kwargs)
    assert fragment in str(info.value), f"{name}: message {str(info.value)!r} does not name {fragment!r}"
    tiers.assert_bytes_equal(before)

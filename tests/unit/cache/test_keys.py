import numpy as np
import pytest
from blake3 import blake3

from fastkv.cache.keys import (
    ExtraKeys,
    KeyNamespace,
    as_tokens,
    block_keys,
    block_keys_reference,
    private_key,
    root_key,
)
from fastkv.config import KVLayout

LAYOUT = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=8, dtype="bfloat16", tp_size=2)
NS = KeyNamespace.for_layout("m", "v1", LAYOUT)


def naive(tokens, bs, parent, extras=None):
    keys = []
    for i in range(len(tokens) // bs):
        data = parent + np.asarray(tokens[i * bs:(i + 1) * bs], np.int32).tobytes() + (extras or {}).get(i, b"")
        parent = blake3(data).digest()
        keys.append(parent)
    return keys


def test_keys_are_chained_and_match_the_naive_definition():
    root = root_key(NS)
    toks = as_tokens(np.arange(14))
    keys = block_keys(toks, 4, root)
    assert len(keys) == 3 and keys == naive(list(range(14)), 4, root)
    # a shared prefix shares keys; a difference changes every later key
    other = toks.copy()
    other[5] = 99
    k2 = block_keys(other, 4, root)
    assert k2[0] == keys[0] and k2[1] != keys[1] and k2[2] != keys[2]
    # continuing from a parent equals computing the whole chain
    assert block_keys(toks, 4, keys[0], first=1) == keys[1:]


@pytest.mark.parametrize("block_size", [1, 4, 16, 64, 256])
def test_the_c_chain_equals_the_blake3_binding(block_size):
    rng = np.random.default_rng(block_size)
    root = root_key(NS)
    for n in (0, block_size - 1, block_size, 7 * block_size + 3, 300 * block_size):  # long: hashed without the GIL
        toks = as_tokens(rng.integers(-2**31, 2**31, n, dtype=np.int64).astype(np.int32))
        keys = block_keys(toks, block_size, root)
        assert keys == block_keys_reference(toks, block_size, root) == naive(toks, block_size, root)
        for first in (1, n // block_size // 2, n // block_size, n // block_size + 2):
            assert block_keys(toks, block_size, root, first) == block_keys_reference(toks, block_size, root, first)


def test_the_c_chain_refuses_what_it_cannot_hash():
    from fastkv.native.compiled import load

    chain = load("_chain")
    with pytest.raises(ValueError, match="parent must be 32 bytes"):
        chain.chain_keys(bytes(64), b"short", 16, 0, 1)
    with pytest.raises(ValueError, match="past the 64 bytes"):
        chain.chain_keys(bytes(64), bytes(32), 16, 2, 3)


@pytest.mark.parametrize("change", [
    dict(weights_version="v2"), dict(kv_dtype="float16"), dict(block_size=8), dict(tp_size=4),
    dict(model_id="m2"), dict(layout="other"),
])
def test_namespace_fingerprints_everything_that_changes_bytes(change):
    fields = dict(model_id="m", weights_version="v1", layout=LAYOUT.describe(), kv_dtype="bfloat16", block_size=4,
                  tp_size=2)
    base = KeyNamespace(**fields)
    assert base.fingerprint == NS.fingerprint
    fields.update(change)
    assert KeyNamespace(**fields).fingerprint != base.fingerprint
    assert root_key(KeyNamespace(**fields)) != root_key(base)


def test_extras_are_domain_separated():
    toks = as_tokens(np.arange(12))
    roots = {root_key(NS), root_key(NS, ExtraKeys(lora_id=1)), root_key(NS, ExtraKeys(lora_id="1x")),
             root_key(NS, ExtraKeys(tenant_salt=b"1")), root_key(NS, ExtraKeys(lora_id=1, tenant_salt=b"1"))}
    assert len(roots) == 5
    mm = ExtraKeys(mm=((5, 7, b"img"),))
    extras = mm.block_extras(4)
    assert set(extras) == {1}
    root = root_key(NS, mm)  # mm items do not change the root, only the blocks they overlap
    assert root == root_key(NS)
    plain, with_mm = block_keys(toks, 4, root), block_keys(toks, 4, root, extras=extras)
    assert plain[0] == with_mm[0] and plain[1] != with_mm[1] and plain[2] != with_mm[2]
    assert with_mm == naive(list(range(12)), 4, root, extras)
    with pytest.raises(ValueError, match="mm items"):
        ExtraKeys(mm=((3, 3, b"x"),))


def test_token_validation():
    assert as_tokens([1, 2, 3]).dtype == np.int32
    assert as_tokens(np.array([1, 2], np.int64)).tolist() == [1, 2]
    assert len(as_tokens([])) == 0
    with pytest.raises(ValueError, match="1-D"):
        as_tokens(np.zeros((2, 2), np.int32))
    with pytest.raises(ValueError, match="integer"):
        as_tokens(np.array([1.5]))
    with pytest.raises(ValueError, match="int32"):
        as_tokens(np.array([2**40]))
    with pytest.raises(ValueError, match="integer"):
        as_tokens(["a"])


def test_private_keys_differ_per_request_and_epoch():
    root = root_key(NS)
    ks = {private_key(NS, root, "r1", 1, [0]), private_key(NS, root, "r2", 1, [0]), private_key(NS, root, "r1", 2, [0])}
    assert len(ks) == 3
    assert private_key(NS, root, "r1", 1, [0]) not in block_keys(as_tokens(np.arange(8)), 4, root)

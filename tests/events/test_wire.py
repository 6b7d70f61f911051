# ruff: noqa: E402  (the imports below need the extra checked first)
"""The wire format's chains, decoded by a decoder written from the public schema (vLLM's
vllm/distributed/kv_events.py, llm-d's pkg/kvcache/kvevents/events.go), and the router's keys.
Each schema against its consumers' own decoders: tests/events/test_schemas.py."""

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import subprocess
import sys

import msgspec
import numpy as np
import pytest

from fastkv.cache.keys import ExtraKeys
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.config import KVLayout
from fastkv.events import EventsConfig
from fastkv.routing import block_hashes, namespace_for
from tests.events import spec_keys
from tests.events.demo_rig import run_demo


# --------------------------------------------------------------- the public schema, written out
def public_schema(array_like: bool):
    opts = {"array_like": array_like, "omit_defaults": True}

    class BlockStored(msgspec.Struct, tag=True, **opts):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None = None
        medium: str | None = None
        lora_name: str | None = None

    class BlockRemoved(msgspec.Struct, tag=True, **opts):
        block_hashes: list[bytes | int]
        medium: str | None = None

    class AllBlocksCleared(msgspec.Struct, tag=True, **opts):
        pass

    class EventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return EventBatch, BlockStored, BlockRemoved, AllBlocksCleared


def test_block_stored_carries_the_chain_a_router_recomputes(tmp_path):
    """Each BlockStored's hashes are the keys of its token ids chained from its parent (by the
    spec, tests/events/spec_keys.py)."""
    cfg = EventsConfig(endpoint=f"ipc://{tmp_path}/pub", buffer_steps=100_000)
    rig, ev = run_demo(cfg)
    try:
        assert ev.sync(10.0)
        EventBatch, BlockStored, *_ = public_schema(True)
        decode = msgspec.msgpack.Decoder(EventBatch).decode
        cache = rig.sched.cache
        roots = {spec_keys.root(ns.fingerprint) for ns in [*cache.state.retired, cache.namespace]}
        checked = 0
        for _, payload in ev.publisher.buffer:
            for e in decode(payload).events:
                if isinstance(e, BlockStored):
                    parents = [e.parent_block_hash] if e.parent_block_hash is not None else list(roots)
                    assert any(spec_keys.chain_from(p, e.token_ids, 16) == e.block_hashes for p in parents)
                    checked += 1
        assert checked > 50
    finally:
        ev.close()


# --------------------------------------------------------------- router keys
def test_router_keys_are_the_engines_keys():
    """The router's keys and the cache's both equal keys computed from the spec in docs/DESIGN.md
    by code of the test's own (tests/events/spec_keys.py): the two cannot agree by sharing a bug."""
    layout = KVLayout(num_layers=2, kv_heads=2, block_size=8, head_dim=8, dtype="bfloat16", tp_size=1)
    cache = CacheManager(CacheConfig(num_device_blocks=8, block_size=8, layout=layout, model_id="m",
                                     weights_version="w3"))
    ns = namespace_for("m", "w3", layout)
    fingerprint = spec_keys.namespace("m", "w3", layout.describe(), "bfloat16", 8, 1)
    assert ns == cache.namespace and ns.fingerprint == cache.namespace.fingerprint == fingerprint
    rng = np.random.default_rng(0)
    extra = ExtraKeys(lora_id=3, mm=((2, 12, b"img"),))
    for n in (0, 7, 8, 9, 64, 100):
        toks = rng.integers(0, 50_000, n).tolist()
        want = spec_keys.chain(toks, fingerprint, 8)
        assert len(want) == n // 8
        assert cache.keys_for(toks) == want
        assert block_hashes(toks, ns, 8) == want == block_hashes(np.asarray(toks, np.int64), ns.fingerprint, 8)
        with_extra = spec_keys.chain(toks, fingerprint, 8, lora_id=3, mm=((2, 12, b"img"),))
        assert block_hashes(toks, ns, 8, extra) == with_extra == cache.keys_for(toks, extra)
        if want:
            assert with_extra != want
    other = namespace_for("m", "w4", layout)
    assert other.fingerprint == spec_keys.namespace("m", "w4", layout.describe(), "bfloat16", 8, 1) != fingerprint
    assert block_hashes(list(range(16)), other, 8) == spec_keys.chain(list(range(16)), other.fingerprint, 8)
    with pytest.raises(ValueError, match="block_size"):
        block_hashes([1, 2], ns, 4)
    with pytest.raises(ValueError, match="fingerprint"):
        block_hashes([1, 2], b"short", 4)


def test_routing_imports_neither_paddle_nor_the_engine():
    code = ("import sys, fastkv.routing, fastkv.routing.indexer; "
            "bad = [m for m in sys.modules if m.startswith(('paddle', 'fastkv.engine', 'fastkv.sched'))]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)

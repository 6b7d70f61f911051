# ruff: noqa: E402  (the imports below need the extra checked first)
"""The reference indexer's bookkeeping: every schema, per-tier sets, the cascade of tiers."""

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import msgspec

from fastkv.cache.residency import Change, KeyInfo
from fastkv.cache.write_policy import Tier
from fastkv.events import build_events
from fastkv.events.schema import SCHEMAS, schema
from fastkv.routing.indexer import EngineView, Prefix

K = [bytes([i]) * 32 for i in range(6)]
TOK = b"\x01\x00\x00\x00" * 2  # two int32 tokens per block


def batch(name, clears, changes):
    s = schema(name)
    events = build_events(clears, changes, 2, s)
    return msgspec.msgpack.decode(msgspec.msgpack.encode(s.EventBatch(1.0, events, 0)))


def stored(tier, keys, parent=None):
    out, p = [], parent
    for k in keys:
        out.append((k, KeyInfo(p, TOK)))
        p = k
    return Change(tier, out, [])


def test_every_schema_builds_the_same_sets_and_the_cascade_follows_the_engines_match_order():
    for enc in SCHEMAS:
        v = EngineView("e")
        v.apply(batch(enc, 0, [stored(Tier.DEVICE, K[:2]), stored(Tier.HOST, K[:4]),
                               stored(Tier.STORAGE, K[3:5], K[2])]))
        assert v.held["GPU"] == set(K[:2]) and v.held["CPU"] == set(K[:4]) and v.held["DISK"] == set(K[3:5])
        assert v.prefix(K) == Prefix(gpu=2, cpu=4, disk=0, total=5)
        v.apply(batch(enc, 0, [Change(Tier.HOST, [], [K[2]])]))
        assert v.prefix(K) == Prefix(2, 2, 0, 2)  # the chain breaks at block 2: nothing past it counts
        v.apply(batch(enc, 1, [stored(Tier.DEVICE, K[:1])]))  # cleared, then what is still held
        assert v.held["GPU"] == {K[0]} and not v.held["CPU"] and v.clears == 1


def test_a_batch_groups_each_chain_into_one_block_stored():
    s = schema("llm-d")
    ch = stored(Tier.DEVICE, K[:3])
    ch.stored.extend(stored(Tier.DEVICE, K[4:6]).stored)  # a second chain from the root
    events = build_events(0, [ch], 2, s)
    assert [e.block_hashes for e in events] == [K[:3], K[4:6]]
    assert [e.parent_block_hash for e in events] == [None, None]
    assert events[0].token_ids == [1] * 6 and events[0].medium == "GPU"

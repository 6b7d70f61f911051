# ruff: noqa: E402  (the imports below need the extra checked first)
"""Each ``--kv-events-schema`` is exactly what its consumers decode: every batch decoded by the
consumers' own struct declarations (tests/events/consumers.py, re-declared from their sources),
live and by replay, rebuilding the engine's index; and refused by the consumers that cannot read
it, as docs/KV_EVENTS.md's table says."""

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import re
from pathlib import Path

import msgspec
import numpy as np
import pytest
import zmq

from fastkv.cache.residency import Change, KeyInfo
from fastkv.cache.write_policy import Tier
from fastkv.events import EventsConfig, build_events
from fastkv.events.config import SCHEMAS
from fastkv.events.schema import schema
from tests.events.consumers import CONSUMERS, READS, VLLM, ConsumerError, fold, llm_d_decode, vllm_decode
from tests.events.demo_rig import engine_index, run_demo

DOC = Path(__file__).resolve().parents[2] / "docs" / "KV_EVENTS.md"
K = [bytes([i + 1]) * 24 + (1000 + i).to_bytes(8, "big") for i in range(6)]
TOK = np.arange(2, dtype=np.int32)


def stored(tier, keys, parent=None):
    out, p = [], parent
    for i, k in enumerate(keys):
        out.append((k, KeyInfo(p, (TOK + 2 * i).tobytes())))
        p = k
    return Change(tier, out, [])


def synthetic(name: str) -> bytes:
    """A cleared cache, a chain of three device blocks, one of two host blocks off K[1], a host removal."""
    host = stored(Tier.HOST, K[3:5], K[1])
    host.removed.append(K[5])
    s = schema(name)
    events = build_events(1, [stored(Tier.DEVICE, K[:3]), host], 2, s)
    return msgspec.msgpack.encode(s.EventBatch(12.5, events, 3))


def test_schema_names_are_the_config_and_the_flag():
    assert tuple(READS) == SCHEMAS and EventsConfig().schema == "llm-d"
    with pytest.raises(ValueError, match="schema"):
        EventsConfig(schema="map")


@pytest.mark.parametrize("name", SCHEMAS)
def test_each_consumer_reads_exactly_the_schemas_it_should(name):
    payload = synthetic(name)
    for consumer, decode in CONSUMERS.items():
        if consumer not in READS[name]:
            with pytest.raises(ConsumerError):
                decode(payload)
            continue
        rank, events = decode(payload)
        f = fold if consumer == "llm-d" else (lambda h: h)
        assert rank == 3, consumer
        assert [e.tag for e in events] == ["AllBlocksCleared", "BlockStored", "BlockRemoved", "BlockStored"]
        _, gpu, removed, cpu = events
        assert gpu.hashes == [f(k) for k in K[:3]] and gpu.parent is None and gpu.medium == "GPU"
        assert gpu.token_ids == [0, 1, 2, 3, 4, 5] and gpu.block_size == 2
        assert cpu.hashes == [f(k) for k in K[3:5]] and cpu.parent == f(K[1]) and cpu.medium == "CPU"
        assert removed.hashes == [f(K[5])] and removed.medium == "CPU"
        assert gpu.lora_name in ((None,) if consumer in ("vllm-lora-name", "vllm-main") else ("absent",))


def test_llm_d_folds_the_last_eight_bytes_big_endian():
    _, events = llm_d_decode(synthetic("llm-d"))
    assert events[1].hashes == [1000, 1001, 1002] and events[3].parent == 1001


def test_vllm_main_events_are_tagged_maps_in_an_array_batch_with_every_required_field():
    raw = msgspec.msgpack.decode(synthetic("vllm"))
    assert isinstance(raw, list) and len(raw) == 3
    ev = raw[1][1]
    assert ev["type"] == "BlockStored"
    # required fields are present even when null; optional ones are absent (one KV group, no extra keys)
    assert {"lora_id", "medium", "lora_name"} <= set(ev) and ev["lora_name"] is None
    assert not {"group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window", "extra_keys"} & set(ev)
    assert set(raw[1][2]) == {"type", "block_hashes", "medium"}


def test_the_vllm_schema_carries_group_fields_when_a_cache_sets_them():
    """fastkv's cache has one KV group and sets none; a hybrid cache would set them per event,
    and vLLM main's decoder reads them."""
    s = schema("vllm")
    ev = s.BlockStored(block_hashes=[K[0]], parent_block_hash=None, token_ids=[1, 2], block_size=2, lora_id=None,
                       medium="GPU", lora_name=None, group_idx=1, kv_cache_spec_kind="sliding_window",
                       kv_cache_spec_sliding_window=128)
    rm = s.BlockRemoved(block_hashes=[K[0]], medium="GPU", group_idx=1)
    batch = msgspec.msgpack.decode(msgspec.msgpack.encode(s.EventBatch(1.0, [ev, rm], 0)), type=VLLM["vllm-main"])
    assert batch.events[0].group_idx == 1 and batch.events[0].kv_cache_spec_kind == "sliding_window"
    assert batch.events[0].kv_cache_spec_sliding_window == 128 and batch.events[1].group_idx == 1


def test_a_schema_change_that_breaks_a_consumer_fails_its_decoder():
    """The decoders are strict where the consumers are: what each mutant of a schema would
    send is refused by the consumer that schema is for."""
    payload = synthetic("vllm-array")
    raw = msgspec.msgpack.decode(payload)
    no_lora_name = [raw[0], [e[:7] if e[0] == "BlockStored" else e for e in raw[1]], raw[2]]
    with pytest.raises(ConsumerError, match="at least length 8"):
        vllm_decode("vllm-lora-name", msgspec.msgpack.encode(no_lora_name))
    raw = msgspec.msgpack.decode(synthetic("vllm"))
    for e in raw[1]:
        e.pop("lora_name", None)  # a required field omitted at its default
    with pytest.raises(ConsumerError, match="lora_name"):
        vllm_decode("vllm-main", msgspec.msgpack.encode(raw))
    raw = msgspec.msgpack.decode(synthetic("llm-d"))
    raw[1][1].append(None)  # a seventh field
    with pytest.raises(ConsumerError, match="7 fields"):
        llm_d_decode(msgspec.msgpack.encode(raw))


def test_the_docs_table_says_what_the_decoders_do():
    """docs/KV_EVENTS.md's consumer table: per schema, 'yes' in a tested column exactly where
    that consumer's decoder reads the schema."""
    text = DOC.read_text()
    header = re.search(r"^\| schema \|(.*)\|$", text, re.M)
    assert header, "docs/KV_EVENTS.md has no consumer table"
    columns = [c.strip() for c in header.group(1).split("|")]
    tested = {"vLLM v0.10-v0.11": "vllm-v0.10", "vLLM with lora_name, array": "vllm-lora-name",
              "vLLM main": "vllm-main", "llm-d": "llm-d"}
    assert set(tested) <= set(columns), columns
    for name in SCHEMAS:
        row = re.search(rf"^\| `{re.escape(name)}` \|(.*)\|$", text, re.M)
        assert row, f"no table row for {name}"
        cells = dict(zip(columns, (c.strip() for c in row.group(1).split("|")), strict=True))
        for column, consumer in tested.items():
            assert cells[column].startswith("yes") == (consumer in READS[name]), (name, column, cells[column])


def _replay(ctx: zmq.Context, endpoint: str) -> list[list[bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(endpoint)
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    frames = []
    while True:
        assert dealer.poll(10_000), "no replay answer"
        f = dealer.recv_multipart()
        if f[1] == (-1).to_bytes(8, "big", signed=True):
            assert f == [b"", f[1], b""]
            break
        frames.append(f)
    dealer.close(linger=0)
    return frames


@pytest.mark.parametrize("name", SCHEMAS)
def test_a_run_in_each_schema_is_read_completely_by_its_consumers_live_and_by_replay(tmp_path, name):
    cfg = EventsConfig(endpoint=f"ipc://{tmp_path}/pub", replay_endpoint=f"ipc://{tmp_path}/replay",
                       topic="kv@pod-a@model", schema=name, buffer_steps=100_000)
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.rcvhwm = 0
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")
    sub.connect(cfg.endpoint)
    live: list[list[bytes]] = []

    def on_step(step, rig, ev):
        while sub.poll(0):
            live.append(sub.recv_multipart())

    rig, ev = run_demo(cfg, on_step)
    try:
        assert ev.sync(10.0)
        replayed = _replay(ctx, cfg.replay_endpoint)
        ev.publisher.close()
        while sub.poll(200):
            live.append(sub.recv_multipart())
        n = ev.publisher.seq
        assert [int.from_bytes(f[1], "big") for f in replayed] == list(range(n))  # every batch, in order
        by_seq = {int.from_bytes(f[1], "big"): f[2] for f in replayed}
        assert live, "no live message arrived"
        for topic, seq8, body in live:  # what went out live is byte for byte what replay sends
            assert topic == b"kv@pod-a@model" and len(seq8) == 8 and body == by_seq[int.from_bytes(seq8, "big")]
        want = engine_index(rig)
        for consumer in READS[name]:
            decode = CONSUMERS[consumer]
            f = fold if consumer == "llm-d" else (lambda h: h)
            held: dict[str, set] = {m: set() for m in want}
            events = 0
            for seq in range(n):
                rank, batch = decode(by_seq[seq])
                assert rank == 0
                events += len(batch)
                for e in batch:
                    if e.tag == "AllBlocksCleared":
                        for keys in held.values():
                            keys.clear()
                    elif e.tag == "BlockStored":
                        assert len(e.token_ids) == e.block_size * len(e.hashes)
                        held[e.medium].update(e.hashes)
                    else:
                        held[e.medium].difference_update(e.hashes)
            assert events == ev.events, consumer
            assert held == {m: {f(k) for k in keys} for m, keys in want.items()}, consumer
            assert any(held.values())
    finally:
        ev.close()
        ctx.destroy(linger=0)


def test_the_flag_and_the_config_key_reach_the_run(tmp_path):
    from fastkv import cli

    args = cli.build_parser().parse_args(["--kv-events-endpoint", "ipc:///tmp/x", "--kv-events-schema", "vllm"])
    spec = cli.JobConfig.from_sources(None, cli._flags(args)).to_spec("r", tmp_path)
    assert spec.events_config().schema == "vllm"
    conf = tmp_path / "job.toml"
    conf.write_text('kv_events_endpoint = "ipc:///tmp/x"\nkv_events_schema = "vllm-array"\n')
    spec = cli.JobConfig.from_sources(str(conf), {}).to_spec("r", tmp_path)
    assert spec.events_config().schema == "vllm-array"
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["--kv-events-schema", "map"])

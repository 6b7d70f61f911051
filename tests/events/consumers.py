"""KV event decoders as each consumer generation declares them, re-declared here from the
consumers' published sources and never from fastkv's code: when fastkv's schema drifts from a
consumer's, these decoders fail and so do the tests that use them.

Sources (field order, required fields, struct options):

* ``vllm-v0.10``: ``vllm/distributed/kv_events.py`` in vLLM's v0.10/v0.11 line, read at
  furiosa-ai/vllm 0e0ca944f9c3073cceb3787de174d8dba39173f9 (a fork at that line): array-like
  events, ``BlockStored`` with six required fields, ``BlockRemoved`` with two.
* ``vllm-lora-name``: the same file after ``lora_name`` was added (vllm-project/vllm PR #27577),
  read at nealvaidya/vllm 2ca8f3a19d7be7d992956a568d8b73d3e69b2176: still array-like, and
  ``lora_name`` required (an array of seven fields after the tag fails to decode).
* ``vllm-main``: after events became tagged maps (vllm-project/vllm PR #42892), read at
  local-inference-lab/vllm b6b82137404e5bc1488ebd4ed18b395fe55b2b9f and kvcop/vllm
  330602f1a597287dd74ada9c3fc60792e6f88e79: the batch stays ``array_like``, events lose it (a
  map with the tag under ``"type"``); ``lora_id``, ``medium``, ``lora_name`` required, the rest
  optional. volcano-sh/kthena issue #1535 shows vLLM v0.26.0's bytes in this form.
* ``vllm-map-batch``: vllm-project/vllm 0181ea3173e53eea8cf04a86891488e3dc89bb34 as stored by
  the index: the same events, but the batch without ``array_like`` (a map). No released wire
  capture shows this form; kept so the tests say which schemas it reads (none).
* ``llm-d``: llm-d/llm-d-kv-cache-manager ``pkg/kvcache/kvevents/events.go`` at
  1a9d0c1e0437dc576dd54a0507e7b253db4f3f3e and ``pool.go`` at
  3f720e81f3aae344ba20daed9d34c58acf2b7ef2: the batch an array of 2 or 3, each event an array
  with its tag at element 0 and the rest re-decoded into an array struct of exactly llm-d's
  fields (``llm_d_decode`` below is that decoder, strict on lengths), hashes as uint64.
"""

from typing import Any

import msgspec

Hash = bytes | int
U64 = 1 << 64


def _vllm(gen: str) -> type:
    """The ``KVEventBatch`` decoder type of a vLLM generation."""
    array_events = gen in ("vllm-v0.10", "vllm-lora-name")
    ev_opts: dict[str, Any] = {"omit_defaults": True, "gc": False, "tag": True}
    if array_events:
        ev_opts["array_like"] = True

    class KVCacheEvent(msgspec.Struct, **ev_opts):
        pass

    if gen == "vllm-v0.10":
        class BlockStored(KVCacheEvent):
            block_hashes: list[Hash]
            parent_block_hash: Hash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
    elif gen == "vllm-lora-name":
        class BlockStored(KVCacheEvent):
            block_hashes: list[Hash]
            parent_block_hash: Hash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
    else:
        class BlockStored(KVCacheEvent):
            block_hashes: list[Hash]
            parent_block_hash: Hash | None
            token_ids: list[int]
            block_size: int
            lora_id: int | None
            medium: str | None
            lora_name: str | None
            extra_keys: list[tuple[Any, ...] | None] | None = None
            group_idx: int | None = None
            kv_cache_spec_kind: str | None = None
            kv_cache_spec_sliding_window: int | None = None
            locality: str | None = None
            ownership: str | None = None
            session_id: str | None = None

    if array_events:
        class BlockRemoved(KVCacheEvent):
            block_hashes: list[Hash]
            medium: str | None
    else:
        class BlockRemoved(KVCacheEvent):
            block_hashes: list[Hash]
            medium: str | None
            group_idx: int | None = None
            locality: str | None = None
            ownership: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    batch_opts: dict[str, Any] = {"omit_defaults": True, "gc": False}
    if gen != "vllm-map-batch":
        batch_opts["array_like"] = True

    class KVEventBatch(msgspec.Struct, **batch_opts):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return KVEventBatch


VLLM = {gen: _vllm(gen) for gen in ("vllm-v0.10", "vllm-lora-name", "vllm-main", "vllm-map-batch")}


class Event(msgspec.Struct):
    """A decoded event, the same for every consumer: what a subscriber keeps of it."""

    tag: str
    hashes: list = []
    parent: Any = None
    token_ids: list = []
    block_size: int = 0
    medium: str | None = None
    lora_name: Any = "absent"  # "absent": the consumer has no such field


class ConsumerError(ValueError):
    pass


def vllm_decode(gen: str, payload: bytes) -> tuple[int | None, list[Event]]:
    """Decode with vLLM generation ``gen``'s structs (ConsumerError when they refuse it)."""
    try:
        batch = msgspec.msgpack.decode(payload, type=VLLM[gen])
    except (msgspec.ValidationError, msgspec.DecodeError) as exc:
        raise ConsumerError(f"{gen}: {exc}") from None
    out = []
    for e in batch.events:
        tag = type(e).__name__
        if tag == "BlockStored":
            out.append(Event(tag, e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium,
                             getattr(e, "lora_name", "absent")))
        elif tag == "BlockRemoved":
            out.append(Event(tag, e.block_hashes, medium=e.medium))
        else:
            out.append(Event(tag))
    return batch.data_parallel_rank, out


def fold(h: Any) -> int:
    """llm-d's block hash: an int as it is (uint64), bytes as the uint64 of their last 8, big-endian."""
    if isinstance(h, bytes):
        if len(h) < 8:
            raise ConsumerError(f"llm-d: a byte hash of {len(h)} bytes")
        return int.from_bytes(h[-8:], "big")
    if isinstance(h, int) and not isinstance(h, bool) and 0 <= h < U64:
        return h
    raise ConsumerError(f"llm-d: block hash {h!r} is neither bytes nor a uint64")


def _opt(v: Any, kind: type, what: str) -> Any:
    if v is not None and not isinstance(v, kind):
        raise ConsumerError(f"llm-d: {what} {v!r} is not {kind.__name__} or nil")
    return v


LLM_D_LEN = {"BlockStored": 7, "BlockRemoved": 3, "AllBlocksCleared": 1}  # tag + llm-d's fields


def llm_d_decode(payload: bytes) -> tuple[int | None, list[Event]]:
    """llm-d's decoder, strictly: the batch an array of 2 or 3 (ts, events, rank); each event an
    array, tag at element 0, exactly llm-d's field count after it; hashes folded to uint64;
    token ids uint32."""
    raw = msgspec.msgpack.decode(payload)
    if not isinstance(raw, list) or len(raw) not in (2, 3):
        raise ConsumerError(f"llm-d: EventBatch must be an array of 2 or 3, got {type(raw).__name__}")
    ts, events = raw[0], raw[1]
    rank = raw[2] if len(raw) == 3 else None
    if not isinstance(ts, float) or not isinstance(events, list):
        raise ConsumerError("llm-d: EventBatch is not [float64, [events...], rank]")
    out = []
    for ev in events:
        if not isinstance(ev, list) or not ev or not isinstance(ev[0], str):
            raise ConsumerError(f"llm-d: an event is not an array with its tag at element 0: {str(ev)[:80]}")
        tag = ev[0]
        if tag not in LLM_D_LEN:
            raise ConsumerError(f"llm-d: unknown event tag {tag!r}")
        if len(ev) != LLM_D_LEN[tag]:
            raise ConsumerError(f"llm-d: {tag} has {len(ev) - 1} fields, llm-d decodes {LLM_D_LEN[tag] - 1}")
        if tag == "BlockStored":
            _, hashes, parent, tokens, block_size, lora_id, medium = ev
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < 1 << 32 for t in tokens):
                raise ConsumerError("llm-d: token ids are not uint32")
            if not isinstance(block_size, int):
                raise ConsumerError("llm-d: block_size is not an int")
            _opt(lora_id, int, "lora_id")
            out.append(Event(tag, [fold(h) for h in hashes], None if parent is None else fold(parent), tokens,
                             block_size, _opt(medium, str, "medium")))
        elif tag == "BlockRemoved":
            out.append(Event(tag, [fold(h) for h in ev[1]], medium=_opt(ev[2], str, "medium")))
        else:
            out.append(Event(tag))
    return rank, out


CONSUMERS = {**{gen: (lambda p, g=gen: vllm_decode(g, p)) for gen in VLLM}, "llm-d": llm_d_decode}

# Which consumer reads which schema completely; docs/KV_EVENTS.md's table says the same
# (test_schemas checks that it does).
READS = {
    "llm-d": {"vllm-v0.10", "llm-d"},
    "vllm-array": {"vllm-v0.10", "vllm-lora-name"},
    "vllm": {"vllm-main"},
}


def apply_batch(held: dict[str, set], batch: list[Event]) -> None:
    """A subscriber's bookkeeping: ``held`` (medium -> block hashes) after one decoded batch."""
    for e in batch:
        if e.tag == "AllBlocksCleared":
            for keys in held.values():
                keys.clear()
        elif e.tag == "BlockStored":
            held[e.medium].update(e.hashes)
        else:
            held[e.medium].difference_update(e.hashes)

"""The KV event wire schemas: vLLM's ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared`` as msgspec structs, one schema per consumer generation.

Consumers decode with msgspec structs or Go msgpack structs whose field order, required fields
and array-vs-map layout are the contract, so each generation is declared exactly:

* ``"llm-d"`` (the default): every struct a msgpack array, an event ``[tag, field, ...]``, a batch
  ``[ts, events, data_parallel_rank]``. ``BlockStored`` has exactly six fields
  (``block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium``),
  ``BlockRemoved`` two (``block_hashes, medium``): what llm-d's released indexer decodes
  (``pkg/kvcache/kvevents/events.go``), and what vLLM sent before ``lora_name``.
* ``"vllm-array"``: the same arrays with ``lora_name`` appended to ``BlockStored`` (seven fields):
  vLLM from the ``lora_name`` field until events became tagged maps. Its decoders need
  the eighth array element; llm-d's strict decoder refuses it.
* ``"vllm"``: vLLM main's form. The batch is still the array ``[ts, events, data_parallel_rank]``;
  each event is a map tagged ``{"type": "BlockStored", ...}`` carrying every required field
  (``lora_id``, ``medium`` and ``lora_name`` present even when null). Optional fields (``extra_keys``,
  ``group_idx``, ``kv_cache_spec_kind``, ``kv_cache_spec_sliding_window``) are omitted at their
  default, as vLLM does. fastkv's cache has one KV group, so it sends none of them; they are
  declared so that a cache with several groups (a hybrid cache) can set them per event without
  a new schema, and the other generations cannot carry them at all.

Block hashes are fastkv's 32-byte chained keys as msgpack bin (vLLM's ``ExternalBlockHash`` is
``bytes | int``; llm-d folds a byte hash to the uint64 of its last 8 bytes, big-endian).
``parent_block_hash`` is None for the first block of a chain. ``medium`` names the tier: "GPU",
"CPU", "DISK".
"""

from typing import Any, NamedTuple

import msgspec

from fastkv.events.config import SCHEMAS as NAMES

MEDIUM = ("GPU", "CPU", "DISK")  # by fastkv.cache.write_policy.Tier: device, host, storage
Hash = bytes | int


class EventSchema(NamedTuple):
    """One wire generation: its structs and the extra fields its ``BlockStored`` must carry."""

    name: str
    EventBatch: type
    BlockStored: type
    BlockRemoved: type
    AllBlocksCleared: type
    stored_extra: dict[str, Any]  # required fields beyond llm-d's six, with the values fastkv sends


def _batch(events_type: Any) -> type:
    class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
        ts: float
        events: list[events_type]
        data_parallel_rank: int | None = None

    return EventBatch


def _llm_d() -> EventSchema:
    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    batch = _batch(BlockStored | BlockRemoved | AllBlocksCleared)
    return EventSchema("llm-d", batch, BlockStored, BlockRemoved, AllBlocksCleared, {})


def _vllm_array() -> EventSchema:
    class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[Hash]
        parent_block_hash: Hash | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None

    class AllBlocksCleared(KVCacheEvent):
        pass

    batch = _batch(BlockStored | BlockRemoved | AllBlocksCleared)
    return EventSchema("vllm-array", batch, BlockStored, BlockRemoved, AllBlocksCleared, {"lora_name": None})


def _vllm() -> EventSchema:
    class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):  # a map, tag under "type"
        pass

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

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[Hash]
        medium: str | None
        group_idx: int | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    batch = _batch(BlockStored | BlockRemoved | AllBlocksCleared)
    return EventSchema("vllm", batch, BlockStored, BlockRemoved, AllBlocksCleared, {"lora_name": None})


SCHEMAS = {s.name: s for s in (_llm_d(), _vllm_array(), _vllm())}
assert tuple(SCHEMAS) == NAMES


def schema(name: str) -> EventSchema:
    if name not in SCHEMAS:
        raise ValueError(f"KV events schema must be one of {NAMES}, got {name!r}")
    return SCHEMAS[name]

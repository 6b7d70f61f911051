"""The KV event wire schema: vLLM's ``EventBatch`` of ``BlockStored`` / ``BlockRemoved`` /
``AllBlocksCleared``, as msgspec structs.

Field order and tags follow vLLM (``vllm/distributed/kv_events.py``) and what llm-d's indexer
decodes (``llm-d/llm-d-kv-cache-manager``, ``pkg/kvcache/kvevents/events.go`` and ``pool.go``):

* ``"array"`` (the default): every struct is a msgpack array; an event is
  ``[tag, field, ...]`` with ``tag`` its class name, a batch ``[ts, events, data_parallel_rank]``.
  llm-d's indexer parses only this form (it reads each event as an array and switches on
  element 0), and vLLM's releases that llm-d was written against sent it.
* ``"map"``: every struct is a msgpack map, an event ``{"type": tag, "block_hashes": ...}``:
  what msgspec makes of vLLM's structs once ``array_like`` is off, as in vLLM's current main.

``BlockStored`` carries llm-d's six fields in vLLM's order (vLLM appends ``lora_name`` and
more, which llm-d skips). In the map form fields at their default are omitted
(``omit_defaults``), as vLLM does; a decoder must accept them absent. Block hashes are fastkv's 32-byte
chained keys as msgpack bin (vLLM's ``ExternalBlockHash`` is ``bytes | int``; llm-d folds a
byte hash to the uint64 of its last 8 bytes, big-endian). ``parent_block_hash`` is None for
the first block of a chain. ``medium`` names the tier: "GPU", "CPU", "DISK" (vLLM's
``MEDIUM_GPU`` and its CPU offloading medium; llm-d lowercases it into a device tier).
"""

from typing import Any

import msgspec

from fastkv.events.config import ENCODINGS

MEDIUM = ("GPU", "CPU", "DISK")  # by fastkv.cache.write_policy.Tier: device, host, storage


def _schema(array_like: bool) -> dict[str, type]:
    opts = {"array_like": array_like, "omit_defaults": True, "gc": False}

    class EventBatch(msgspec.Struct, **opts):
        ts: float
        events: list[Any]
        data_parallel_rank: int | None = None

    class KVCacheEvent(msgspec.Struct, tag=True, **opts):
        pass

    class BlockStored(KVCacheEvent):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None = None
        medium: str | None = None

    class BlockRemoved(KVCacheEvent):
        block_hashes: list[bytes | int]
        medium: str | None = None

    class AllBlocksCleared(KVCacheEvent):
        pass

    class KVEventBatch(EventBatch):
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]

    return {"EventBatch": KVEventBatch, "BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
            "AllBlocksCleared": AllBlocksCleared}


SCHEMAS = {"array": _schema(True), "map": _schema(False)}


def schema(encoding: str) -> dict[str, type]:
    if encoding not in SCHEMAS:
        raise ValueError(f"KV events encoding must be one of {ENCODINGS}, got {encoding!r}")
    return SCHEMAS[encoding]

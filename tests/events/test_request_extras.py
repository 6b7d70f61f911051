# ruff: noqa: E402  (the imports below need the extra checked first)
"""What a request brings besides its tokens reaches its KV events as vLLM's schema defines them: the
adapter in ``lora_id`` (an int id) or ``lora_name`` (a named one), each block's item hashes and
adapter in ``extra_keys``; the tenant's salt never leaves the engine, in any schema."""

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import msgspec
import numpy as np
import pytest

from fastkv.cache.keys import ExtraKeys
from fastkv.cache.residency import ResidencyLog
from fastkv.events import build_events
from fastkv.events.config import SCHEMAS
from fastkv.events.schema import schema
from tests.events.consumers import VLLM
from tests.unit.cache.test_manager import BS, mk

SALT = "tenant-s3cret"
IMAGE = "ab" * 16


def _payload(name: str, **extras) -> bytes:
    """The batch of one request's prompt (3 full blocks, an image over block 1) computed on the device."""
    m = mk()
    log = m.watch_residency(ResidencyLog())
    prompt = np.arange(1, 3 * BS + 2, dtype=np.int32)
    extra = ExtraKeys.of(mm_items=[{"start": BS + 1, "end": BS + 3, "hash": IMAGE}], **extras)
    m.allocate("r", prompt, extra)
    m.mark_computed("r", len(prompt))
    s = schema(name)
    return msgspec.msgpack.encode(s.EventBatch(1.0, build_events(*log.take(), BS, s), 0))


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_salt_is_never_published(name):
    assert SALT.encode() not in _payload(name, cache_salt=SALT, lora="adapter-x")


def test_vllm_main_reads_the_adapters_name_and_each_blocks_extra_keys():
    (ev,) = msgspec.msgpack.decode(_payload("vllm", cache_salt=SALT, lora="adapter-x"), type=VLLM["vllm-main"]).events
    assert ev.lora_name == "adapter-x" and ev.lora_id is None
    assert ev.extra_keys == [("adapter-x",), (IMAGE, "adapter-x"), ("adapter-x",)]
    (plain,) = msgspec.msgpack.decode(_payload("vllm", cache_salt=SALT), type=VLLM["vllm-main"]).events
    assert plain.lora_name is None and plain.extra_keys == [None, (IMAGE,), None]


@pytest.mark.parametrize("name", SCHEMAS)
def test_an_int_adapter_is_the_lora_id_of_every_schema(name):
    raw = msgspec.msgpack.decode(_payload(name, lora=7))[1][0]
    assert (raw["lora_id"] if isinstance(raw, dict) else raw[5]) == 7

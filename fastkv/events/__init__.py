"""KV events: every tier's block changes, published in the format KV-aware routers read.

``KVEvents.attach(cache, config)`` makes the cache's residency maps report their changes
(fastkv.cache.residency) and ``flush()``, once per engine step, takes the step's net changes
and hands them to the publisher's thread (fastkv.events.publisher), which builds, encodes and
sends them as one ``EventBatch`` (fastkv.events.schema): the engine thread does no more than
take the changes.
pyzmq and msgspec are the ``events`` extra: ``pip install 'fastkv[events]'``.
"""
from __future__ import annotations

import time
from functools import partial

import numpy as np
from blake3 import blake3

from fastkv.cache.residency import Change, KeyInfo, ResidencyLog
from fastkv.cache.write_policy import Tier
from fastkv.events.config import EventsConfig

__all__ = ["EventsConfig", "KVEvents", "build_events"]


def build_events(clears: int, changes: list[Change], block_size: int, schema) -> list:
    """The events of one batch in ``schema`` (fastkv.events.schema.EventSchema): AllBlocksCleared
    first, then per tier the removals and the stores, consecutive blocks of one chain in one
    BlockStored (as vLLM groups a request's), with its chain's adapter and its blocks' items. A
    hybrid layout's changes come per KV cache group, and each event carries the group's
    ``group_idx`` (BlockStored also ``kv_cache_spec_kind`` and ``kv_cache_spec_sliding_window``)."""
    from fastkv.events.schema import MEDIUM

    removed_cls, extra = schema.BlockRemoved, schema.stored_extra
    stored_cls = partial(schema.BlockStored, **extra) if extra else schema.BlockStored
    fields = schema.BlockStored.__struct_fields__
    events: list = [schema.AllBlocksCleared()] if clears else []
    for ch in changes:
        medium = MEDIUM[ch.tier]
        stored = stored_cls
        if ch.group is not None:  # a hybrid's: every event names its KV cache group, as vLLM's do
            if "group_idx" not in fields:
                raise ValueError(f"KV events schema {schema.name!r} cannot name a block's KV cache group")
            g = ch.group
            stored = partial(stored_cls, group_idx=g.index, kv_cache_spec_kind=g.kind,
                             kv_cache_spec_sliding_window=g.window)
        if ch.removed:
            events.append(removed_cls(ch.removed, medium) if ch.group is None else
                          removed_cls(ch.removed, medium, group_idx=ch.group.index))
        run: list[bytes] = []
        infos: list[KeyInfo] = []
        for k, info in ch.stored:
            if run and info.parent != run[-1]:
                events.append(_stored(stored, fields, run, infos, block_size, medium))
                run, infos = [], []
            run.append(k)
            infos.append(info)
        if run:
            events.append(_stored(stored, fields, run, infos, block_size, medium))
    return events


def _stored(stored_cls, fields: tuple[str, ...], run: list[bytes], infos: list[KeyInfo], block_size: int,
            medium: str):
    """One BlockStored. The adapter goes in ``lora_id`` (an int id) or ``lora_name`` (a named one)
    where the schema has them; ``extra_keys`` (vLLM's: per block, what keyed it besides its tokens)
    lists the hex hashes of the items a block overlaps, then the adapter's name. The tenant's salt
    is never sent: its keys already keep tenants apart, and a digest of a guessable salt would let
    a subscriber test guesses."""
    lora = infos[0].lora  # one chain, one adapter
    named = lora if isinstance(lora, str) else None
    more = {}
    if named is not None and "lora_name" in fields:
        more["lora_name"] = named
    if "extra_keys" in fields and (named is not None or any(i.items for i in infos)):
        more["extra_keys"] = [tuple(d.hex() for d in i.items) + ((named,) if named is not None else ()) or None
                              for i in infos]
    return stored_cls(block_hashes=run, parent_block_hash=infos[0].parent, token_ids=_ids([i.tokens for i in infos]),
                      block_size=block_size, lora_id=lora if isinstance(lora, int) else None, medium=medium, **more)


def _ids(toks: list[bytes]) -> list[int]:
    return np.frombuffer(b"".join(toks), np.int32).tolist()


def resident_digest(keys) -> dict[str, object]:
    return {"keys": len(keys), "digest": blake3(b"".join(sorted(keys))).hexdigest()}


class KVEvents:
    """One engine's event source: its cache's residency log and a publisher."""

    def __init__(self, cache, config: EventsConfig, publisher=None) -> None:
        from fastkv.events.publisher import ZmqPublisher
        from fastkv.events.schema import schema

        self.config = config
        self.block_size = cache.block_size
        self.log = cache.watch_residency(ResidencyLog())
        self.schema = schema(config.schema)
        self.publisher = publisher if publisher is not None else ZmqPublisher(config)
        self.events = 0
        self.flush_s = 0.0  # engine-thread time spent publishing (the events' cost to the step)
        self.flush_cpu_s = 0.0  # of it, CPU time (less waits for the GIL or for a core)
        self.flushes = 0

    @classmethod
    def attach(cls, cache, config: EventsConfig) -> KVEvents | None:
        """Events for ``cache`` when ``config`` has an endpoint, else None (off)."""
        return cls(cache, config) if config.enabled else None

    def flush(self) -> int | None:
        """Publish the changes since the last flush as one batch (none when nothing changed);
        returns its sequence number."""
        t0, c0 = time.perf_counter(), time.thread_time()
        clears, changes = self.log.take()
        seq = None
        if clears or changes:
            seq = self.publisher.publish(partial(self._batch, time.time(), clears, changes))
        self.flushes += 1
        self.flush_cpu_s += time.thread_time() - c0
        self.flush_s += time.perf_counter() - t0
        return seq

    def _batch(self, ts: float, clears: int, changes: list[Change]) -> object:
        """The EventBatch of one flush's changes (on the publisher thread)."""
        events = build_events(clears, changes, self.block_size, self.schema)
        self.events += len(events)
        return self.schema.EventBatch(ts, events, self.config.data_parallel_rank)

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every batch flushed so far is encoded, buffered and sent."""
        return self.publisher.sync(timeout)

    def resident(self) -> dict[str, dict[str, object]]:
        """Per medium, the chained keys the tier holds now, read off its residency map (the
        partial blocks' private, resume and tail keys, never announced, left out): how many, and
        a digest of them (docs/FORMATS.md: BLAKE3 of the 32-byte keys sorted ascending and
        concatenated); a hybrid's device tier per KV cache group, ``GPU/<group_idx>``. A
        subscriber that applied every batch must hold exactly these: the maps, not the log that
        announces them, are the truth."""
        from fastkv.events.schema import MEDIUM

        log = self.log
        if hasattr(log, "resident_keys"):  # a hybrid's: its one tier per KV cache group (GroupedResidency)
            groups = {name: resident_digest(keys) for name, keys in log.resident_keys().items()}
            return {**groups, **{MEDIUM[t]: resident_digest([]) for t in Tier if t is not Tier.DEVICE}}
        return {MEDIUM[t]: resident_digest([k for k in log.maps[t] if k in log.announced or k in log.pending])
                for t in Tier}

    def stats(self) -> dict[str, int | float]:
        n = max(self.flushes, 1)
        return {**self.publisher.stats(), "events": self.events, "flushes": self.flushes,
                "flush_us_mean": round(1e6 * self.flush_s / n, 2),
                "flush_cpu_us_mean": round(1e6 * self.flush_cpu_s / n, 2)}

    def close(self) -> None:
        self.flush()
        self.publisher.close()

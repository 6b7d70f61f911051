"""Prefill -> decode handoff through the shared store, the engines' side (``--role``).

A prefill engine (``Exporter``) runs each request's prompt, and before the finished request's
blocks are freed copies the KV of every token but the last to the storage tier
(``fastkv.cache.handoff``). Once all of it is stored it appends one line to
``handoff.jsonl`` in its output directory: ``{"id", "ok", "blocks", "bytes", "seconds"}``,
announced to a decode run that follows the file (``fastkv.engine.handoff_stream``).
The record is written only after the blocks, so a decode engine that reads it trusts the
store to hold them (a value evicted since is a miss: it recomputes from there, counted).

A decode engine (``fastkv.engine.decode``, then ``Engine.reserve_for_prefilled``) takes the
recorded requests in order: it reserves blocks for each, refusing with a reason while its
running requests need the room (they are never preempted for a newcomer; a refused request
is asked again every step), LOADs the prompt's KV from the store and decodes.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastkv.cache.manager import CacheManager
from fastkv.cache.plan import CopyPlan
from fastkv.engine.handoff_stream import Announcer
from fastkv.run import HANDOFF_FILE
from fastkv.sched.request import Request

RETRIES = 8  # copies of an export again from the prefix cache before it counts as lost


@dataclass(slots=True)
class HandoffStats:
    role: str
    requests: int = 0  # exported (prefill) or reserved (decode)
    failed: int = 0  # prefill: exports lost; decode: records that said so (computed here)
    blocks: int = 0
    bytes: int = 0
    seconds: float = 0.0  # summed: finish -> stored (prefill), reserve -> KV in place (decode)
    recomputed_prompt_tokens: int = 0  # decode: prompt tokens before the last that storage did not serve
    refused: int = 0
    refusals: dict[str, str] = field(default_factory=dict)  # request id -> the first refusal's reason

    def to_json(self) -> dict[str, Any]:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["seconds_mean"] = self.seconds / self.requests if self.requests else 0.0
        return d


class Exporter:
    """The prefill side: export at finish, record once stored (module docstring)."""

    def __init__(self, cache: CacheManager, out_dir: str | Path, block_bytes: int, name: Any,
                 emit: Callable[[list[CopyPlan]], None]) -> None:
        self.cache, self.block_bytes, self.name = cache, block_bytes, name  # name(rid) -> the caller's id
        self.emit = emit  # copies to hand out with the next step
        self.stream = Announcer(Path(out_dir) / HANDOFF_FILE)
        self.stats = HandoffStats("prefill")
        self._pending: dict[str, tuple[list[bytes], float]] = {}
        self._retries: dict[str, int] = {}

    def before_free(self, req: Request) -> list[CopyPlan]:
        ext, cache = self.name(req.request_id), self.cache
        tail = cache.tail_key(req.token_ids[:req.num_prompt_tokens], ext)
        keys, plans = cache.export(req.request_id, req.num_prompt_tokens - 1, tail)
        self._pending[ext] = (keys, time.monotonic())
        return plans

    def poll(self) -> None:
        """Record the exports that are complete (or lost); call after copy completions."""
        lines = []
        cache = self.cache
        for ext, (keys, t0) in list(self._pending.items()):
            ok = cache.exported(keys)
            if ok is False and self._retries.get(ext, 0) < RETRIES:
                # a block found no host room (copies in flight held it all), or its copy failed: again
                plans = cache.retry_export(keys)
                if plans:
                    self._retries[ext] = self._retries.get(ext, 0) + 1
                    self.emit(plans)
                if plans or cache.has_copies_in_flight():
                    continue
            if ok is None:
                continue
            del self._pending[ext]
            self._retries.pop(ext, None)
            cache.release_export(keys)
            st, seconds = self.stats, time.monotonic() - t0
            st.requests += 1
            st.failed += not ok
            st.blocks += len(keys)
            st.bytes += len(keys) * self.block_bytes
            st.seconds += seconds
            lines.append({"id": ext, "ok": ok, "blocks": len(keys), "bytes": len(keys) * self.block_bytes,
                          "seconds": round(seconds, 6)})
        if lines:
            self.stream.append(lines)

    def __bool__(self) -> bool:
        return bool(self._pending)

"""Prefill -> decode handoff through the shared store, the engines' side (``--role``).

A prefill engine (``Exporter``) runs each request's prompt, and before the finished request's
blocks are freed copies the KV of every token but the last to the storage tier
(``fastkv.cache.handoff``). Once all of it is stored it appends one line to
``handoff.jsonl`` in its output directory: ``{"id", "ok", "blocks", "bytes", "seconds"}``.
The record is written only after the blocks, so a decode engine that reads it trusts the
store to hold them (a value evicted since is a miss: it recomputes from there, counted).

A decode engine (``decode_items``, then ``Engine.reserve_for_prefilled``) takes the
recorded requests in order: it reserves blocks for each, refusing with a reason while its
running requests need the room (they are never preempted for a newcomer; a refused request
is asked again once a request finishes), LOADs the prompt's KV from the store and decodes.
"""
from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastkv.cache import handoff
from fastkv.cache.manager import CacheManager
from fastkv.cache.plan import CopyPlan
from fastkv.sched.request import Request

RECORD = "handoff.jsonl"
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
        self.path = Path(out_dir) / RECORD
        self.path.write_text("")
        self.stats = HandoffStats("prefill")
        self._pending: dict[str, tuple[list[bytes], float]] = {}
        self._retries: dict[str, int] = {}

    def before_free(self, req: Request) -> list[CopyPlan]:
        ext, cache = self.name(req.request_id), self.cache
        prompt = req.token_ids[:req.num_prompt_tokens]
        tail = handoff.tail_key(cache.state, cache.keys_for(prompt), cache.state.root, ext, prompt.tolist())
        keys, plans = handoff.export(cache.state, req.request_id, req.num_prompt_tokens - 1, tail)
        self._pending[ext] = (keys, time.monotonic())
        return plans

    def poll(self) -> None:
        """Record the exports that are complete (or lost); call after copy completions."""
        lines = []
        state = self.cache.state
        for ext, (keys, t0) in list(self._pending.items()):
            ok = handoff.exported(state, keys)
            if ok is False and self._retries.get(ext, 0) < RETRIES:
                # a block found no host room (copies in flight held it all): again once they free some
                plans = handoff.retry(state, keys)
                if plans:
                    self._retries[ext] = self._retries.get(ext, 0) + 1
                    self.emit(plans)
                if plans or state.copies.records:
                    continue
            if ok is None:
                continue
            del self._pending[ext]
            self._retries.pop(ext, None)
            st, seconds = self.stats, time.monotonic() - t0
            st.requests += 1
            st.failed += not ok
            st.blocks += len(keys)
            st.bytes += len(keys) * self.block_bytes
            st.seconds += seconds
            lines.append(json.dumps({"id": ext, "ok": ok, "blocks": len(keys), "bytes": len(keys) * self.block_bytes,
                                     "seconds": round(seconds, 6)}) + "\n")
        if lines:
            with self.path.open("a") as f:
                f.write("".join(lines))

    def __bool__(self) -> bool:
        return bool(self._pending)


def read_records(path: str | Path) -> list[dict[str, Any]]:
    """A prefill run's handoff.jsonl; ValueError naming the line that is wrong."""
    out = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        try:
            doc = json.loads(line)
            if not isinstance(doc.get("id"), str) or not isinstance(doc.get("ok"), bool):
                raise ValueError("needs a string 'id' and a bool 'ok'")
        except (ValueError, AttributeError) as exc:
            raise ValueError(f"{path}:{n}: not a handoff record ({exc})") from None
        out.append(doc)
    return out


def drive_decode(engine: Any, items: list[Any], results: list[Any]) -> None:
    """The decode role's loop: take the prefill run's recorded requests in order, each as soon
    as the engine reserves blocks for it (asked again every step while refused), and step until
    all are done or ``stop``. A record that says its export was lost is computed here."""
    from fastkv.engine.core import EngineError, RequestRejected
    from fastkv.sched.reservation import Refusal

    stats = engine.handoff_stats = HandoffStats("decode")
    by_id = {it.id: it for it in items}
    queue = deque((by_id[r["id"]], r["ok"]) for r in read_records(engine.spec.handoff) if r["id"] in by_id)
    while queue or engine.has_work():
        if engine.ends.signals["stop"]:
            break
        while queue:
            it, ok = queue[0]
            try:
                if not ok:
                    stats.failed += 1
                    engine.add_request(it.prompt, it.max_new_tokens, request_id=it.id, preemption=it.preemption)
                else:
                    got = engine.reserve_for_prefilled(it.prompt, it.max_new_tokens, request_id=it.id,
                                                       preemption=it.preemption)
                    if isinstance(got, Refusal):
                        stats.refused += it.id not in stats.refusals
                        stats.refusals.setdefault(it.id, got.detail)
                        if not engine.has_work():
                            raise EngineError(f"decode engine idle and still refuses: {got.detail}")
                        break
            except RequestRejected as exc:
                results.append(engine.rejected(it.id, exc.reason, time.monotonic()))
            queue.popleft()
        results += engine.step() if engine.has_work() else []
    engine.check_workers()
    layout = engine.spec.layout
    stats.blocks = engine.cache.stats.load_blocks
    stats.bytes = stats.blocks * layout.block_bytes * engine.spec.tp_size

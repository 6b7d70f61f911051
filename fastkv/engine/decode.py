"""The decode role's loop (``--role decode``): take the prefill run's requests as its
handoff file announces them (``fastkv.engine.handoff_stream``) and decode them here,
sampling the run's timeline as the other roles do."""
from __future__ import annotations

import time
from collections import deque
from typing import Any

from fastkv.engine.core import Engine, EngineError, RequestRejected
from fastkv.engine.handoff import HandoffStats
from fastkv.engine.handoff_stream import Follower
from fastkv.engine.timeline import Timeline
from fastkv.sched.reservation import Refusal


def drive_decode(engine: Engine, items: list[Any], results: list[Any], timeline: list | None = None) -> None:
    """The decode role's loop: take the prefill run's records as they come
    (``fastkv.engine.handoff_stream``), each as soon as the engine reserves blocks for it
    (asked again every step while refused), and step until the prefill run has ended and all
    are done, or ``stop``. A record that says its export was lost is computed here."""
    stats = engine.handoff_stats = HandoffStats("decode")
    by_id = {it.id: it for it in items}
    follow = Follower(engine.spec.handoff)
    queue: deque[tuple[Any, bool]] = deque()
    samples = Timeline([] if timeline is None else timeline)  # sampled as any run's (fastkv.engine.timeline)
    try:
        while not engine.ends.signals["stop"]:
            try:
                records = follow.read()
            except ValueError as exc:  # a bad line, named file:line: the run cannot follow the file
                raise EngineError(f"--handoff {exc}") from None
            queue += [(by_id[r["id"]], r["ok"]) for r in records if r["id"] in by_id]
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
            if engine.has_work():
                done = engine.step()
                results += done
                samples.sample(engine, len(results), force=bool(done))
            elif follow.end is not None:
                break
            else:  # idle until the prefill run appends
                engine.beat()
                died = follow.wait(engine.spec.heartbeat_s)
                if died:
                    raise EngineError(died)
    finally:
        follow.close()
    engine.check_workers()
    layout = engine.spec.layout
    stats.blocks = engine.cache.stats.load_blocks
    stats.bytes = stats.blocks * layout.block_bytes * engine.spec.tp_size

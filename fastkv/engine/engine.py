"""The engine process: a workload in, results and a summary out.

``main(spec_json, workload_path)`` attaches the run the supervisor created, reads
``workload.jsonl``, submits each request at its ``arrival_s`` offset from the start (all 0:
a closed loop, everything queued at once), steps the engine until every request finished,
and writes ``results.jsonl`` and ``summary.json`` to ``spec.out_dir`` (formats: SEAMS.md).
It beats ``engine.beat``, sets ``engine.ready`` once attached, and keeps ``engine.total`` /
``engine.finished`` current for the supervisor's progress bar. Between arrivals it blocks
on the inbox doorbell (copy completions wake it), never in a sleep.

Exit status: 0 when the workload is done or ``stop`` was set (results so far are written);
1 when a worker died or failed (``EngineError``), with the reason on stderr.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from fastkv.engine.core import Engine, EngineError, RequestResult
from fastkv.run import VERIFY_COUNTERS, RunSpec

MODES = ("recompute", "offload", "storage", "auto")
_TIMELINE_EVERY_S = 0.25


class WorkItem(NamedTuple):
    id: str
    arrival_s: float
    prompt: list[int]
    max_new_tokens: int
    preemption: str | None


def read_workload(path: str | Path) -> list[WorkItem]:
    """Parse workload.jsonl; ValueError naming the line and field that is wrong."""
    items, seen = [], set()
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        where = f"{path}:{n}"
        try:
            doc = json.loads(line)
        except ValueError as exc:
            raise ValueError(f"{where}: not JSON ({exc})") from None
        if not isinstance(doc, dict):
            raise ValueError(f"{where}: expected a JSON object")
        rid, arrival, prompt = doc.get("id"), doc.get("arrival_s", 0.0), doc.get("prompt")
        max_new, mode = doc.get("max_new_tokens"), doc.get("preemption")
        if not isinstance(rid, str) or rid in seen:
            raise ValueError(f"{where}: 'id' must be a unique string, got {rid!r}")
        if not isinstance(arrival, int | float) or arrival < 0 or not math.isfinite(arrival):
            raise ValueError(f"{where}: 'arrival_s' must be a number >= 0, got {arrival!r}")
        if not isinstance(prompt, list) or not prompt or not all(isinstance(t, int) and t >= 0 for t in prompt):
            raise ValueError(f"{where}: 'prompt' must be a non-empty list of token ids >= 0")
        if not isinstance(max_new, int) or max_new < 1:
            raise ValueError(f"{where}: 'max_new_tokens' must be an int >= 1, got {max_new!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"{where}: 'preemption' must be null or one of {MODES}, got {mode!r}")
        seen.add(rid)
        items.append(WorkItem(rid, float(arrival), prompt, max_new, mode))
    items.sort(key=lambda it: it.arrival_s)  # stable: equal arrivals keep file order
    return items


def drive(engine: Engine, items: list[WorkItem]) -> tuple[list[RequestResult], list[list[float]], float]:
    """Submit at arrival offsets and step until done or ``stop``; returns the results, the
    timeline ``[t_s, finished, generated_tokens, preemptions]`` and the seconds taken."""
    sig, spec = engine.ends.signals, engine.spec
    start = time.monotonic()
    results: list[RequestResult] = []
    timeline: list[list[float]] = [[0.0, 0, 0, 0]]
    next_item, last_point = 0, 0.0
    while next_item < len(items) or engine.has_work():
        if sig["stop"]:
            break
        now = time.monotonic()
        while next_item < len(items) and items[next_item].arrival_s <= now - start:
            it = items[next_item]
            engine.add_request(it.prompt, it.max_new_tokens, request_id=it.id, preemption=it.preemption,
                               arrival_time=start + it.arrival_s)
            next_item += 1
        if engine.has_work():
            done = engine.step()
        else:  # nothing to do before the next arrival
            engine.wait(min(spec.heartbeat_s, start + items[next_item].arrival_s - now))
            done = []
        results += done
        t = time.monotonic() - start
        if done or t - last_point >= _TIMELINE_EVERY_S:
            timeline.append([round(t, 4), len(results), engine.metrics.tokens_sampled,
                             sum(engine.metrics.preemptions().values())])
            last_point = t
    seconds = time.monotonic() - start
    engine.check_workers()  # a rank that died after its last step must not pass for a clean run
    timeline.append([round(seconds, 4), len(results), engine.metrics.tokens_sampled,
                     sum(engine.metrics.preemptions().values())])
    return results, timeline, seconds


def summarize(engine: Engine, items: list[WorkItem], results: list[RequestResult], timeline: list,
              seconds: float) -> dict[str, Any]:
    generated = sum(len(r.output) for r in results)
    sig, ranks = engine.ends.signals, range(engine.spec.tp_size)
    return {
        "requests": len(results),
        "prompt_tokens": sum(len(it.prompt) for it in items),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        **engine.metrics.summary(),
        # what the workers' runners verified (summed over ranks); a mismatch fails the run
        "verified": {c: sum(sig[f"worker{r}.{c}"] for r in ranks) for c in VERIFY_COUNTERS},
        "host_checksum_mismatches": sum(sig[f"transfer{r}.host_checksum_mismatches"] for r in ranks),
        "timeline": timeline,
    }


def write_outputs(out_dir: str | Path, results: list[RequestResult], summary: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # NaN (no token sampled) is not JSON: write null.
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.to_json().items()}
            for r in results]
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def serve_workload(spec: RunSpec, workload_path: str | Path, client_factory: Callable | None = None,
                   check: bool = False) -> int:
    """The engine process's body (``client_factory``, ``check``: see ``Engine``)."""
    items = read_workload(workload_path)
    engine = Engine.attach(spec, client_factory, check=check)
    try:
        port = engine.metrics.serve(spec.metrics_port)
        if port:
            print(f"fastkv engine: metrics on http://127.0.0.1:{port}/metrics", file=sys.stderr, flush=True)
        engine.ends.signals["engine.total"] = len(items)
        engine.wait_until_ready()
        engine.ends.signals["engine.ready"] = 1
        results, timeline, seconds = drive(engine, items)
        write_outputs(spec.out_dir, results, summarize(engine, items, results, timeline, seconds))
        return 0
    except EngineError as exc:
        print(f"fastkv engine: {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        engine.ends.signals["engine.ready"] = 0
        engine.close()


def main(spec_json: str, workload_path: str) -> int:
    return serve_workload(RunSpec.from_json(spec_json), workload_path)

"""The engine process: a workload in, results and a summary out.

``main(spec_json, workload_path)`` attaches the run the supervisor created, reads
``workload.jsonl``, submits each request at its ``arrival_s`` offset from the start (all 0:
a closed loop, everything queued at once), steps the engine until every request finished,
and writes ``results.jsonl`` and ``summary.json`` to ``spec.out_dir`` (formats: docs/FORMATS.md).
It beats ``engine.beat``, sets ``engine.ready`` once attached, and keeps ``engine.total`` /
``engine.finished`` current for the supervisor's progress bar. Between arrivals it blocks
on the inbox doorbell (copy completions wake it), never in a sleep.

Every request of the workload gets a line in ``results.jsonl`` whatever happens, with its
``state``: finished, aborted, rejected (``add_request`` refused it; ``error`` says why) or
unfinished (the run stopped or failed first; its output so far). ``summary.json`` is always
written, its ``status`` "done", "stopped" or "failed: <why>" and ``states`` the counts.
When the engine never got to write them (it was killed, or never started), the supervisor
writes them with ``write_missing``.

Exit status: 0 when the workload is done or ``stop`` was set; 1 when a worker died or
failed (``EngineError``), with the reason on stderr.
"""
from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

from fastkv.engine.core import Engine, EngineError, EngineStopped, RequestRejected, RequestResult
from fastkv.engine.decode import drive_decode
from fastkv.engine.health import counters
from fastkv.engine.timeline import Timeline, point
from fastkv.procs.cpu_policy import apply as apply_cpu_policy
from fastkv.run import EXITING, READY, RunSpec
from fastkv.workload import arrival_error, keyed_error, prompt_error

MODES = ("recompute", "offload", "storage", "auto")


class WorkItem(NamedTuple):
    id: str
    arrival_s: float
    prompt: list[int]
    max_new_tokens: int
    preemption: str | None
    # what keys its KV besides the tokens (Engine.add_request): a tenant's salt, a LoRA adapter, images
    cache_salt: str | None = None
    lora: str | int | None = None
    mm_items: tuple = ()
    cache: bool | dict | None = None  # its cache policy (fastkv.cache.request_policy)



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
        problem = arrival_error(arrival) or prompt_error(prompt)
        if problem:
            raise ValueError(f"{where}: request {rid!r}: {problem}")
        if not isinstance(max_new, int) or isinstance(max_new, bool) or max_new < 1:
            raise ValueError(f"{where}: request {rid!r}: 'max_new_tokens' must be an int >= 1, got {max_new!r}")
        if mode is not None and mode not in MODES:
            raise ValueError(f"{where}: request {rid!r}: 'preemption' must be null or one of {MODES}, got {mode!r}")
        if problem := keyed_error(doc):
            raise ValueError(f"{where}: request {rid!r}: {problem}")
        seen.add(rid)
        items.append(WorkItem(rid, float(arrival), prompt, max_new, mode, doc.get("cache_salt"), doc.get("lora"),
                              tuple(doc.get("mm_items") or ()), doc.get("cache")))
    items.sort(key=lambda it: it.arrival_s)  # stable: equal arrivals keep file order
    return items


def drive(engine: Engine, items: list[WorkItem], results: list[RequestResult], timeline: list[list[float]]) -> None:
    """Submit at arrival offsets and step until done or ``stop``, appending to ``results``
    and to the timeline ``[t_s, finished, generated_tokens, preemptions]`` (the caller keeps
    both when this raises)."""
    sig, spec = engine.ends.signals, engine.spec
    updates = spec.weight_updates()
    start = time.monotonic()
    next_item, samples = 0, Timeline(timeline)
    while next_item < len(items) or engine.has_work():
        if sig["stop"]:
            break
        now = time.monotonic()
        while next_item < len(items) and items[next_item].arrival_s <= now - start:
            it = items[next_item]
            next_item += 1
            try:
                engine.add_request(it.prompt, it.max_new_tokens, request_id=it.id, preemption=it.preemption,
                                   arrival_time=start + it.arrival_s, cache_salt=it.cache_salt, lora=it.lora,
                                   mm_items=it.mm_items, cache=it.cache)
            except RequestRejected as exc:  # this request alone: the rest of the run goes on
                print(f"fastkv engine: {exc}", file=sys.stderr, flush=True)
                results.append(engine.rejected(it.id, exc.reason, start + it.arrival_s))
        if engine.has_work():
            done = engine.step()
        elif next_item < len(items):  # nothing to do before the next arrival
            engine.wait(min(spec.heartbeat_s, start + items[next_item].arrival_s - now))
            done = []
        else:
            break  # the last arrivals were rejected
        results += done
        while updates and sum(r.state == "finished" for r in results) >= updates[0][0]:
            results += engine.update_weights(updates.pop(0)[1], free_memory=spec.free_memory_on_update).finished
        samples.sample(engine, len(results), force=bool(done))
    engine.check_workers()  # a rank that died after its last step must not pass for a clean run


def _not_run(item: WorkItem, state: str, reason: str = "") -> RequestResult:
    return RequestResult(item.id, [], state, math.nan, math.nan, 0, 0, state, reason)


def complete(items: list[WorkItem], results: list[RequestResult]) -> list[RequestResult]:
    """``results`` plus an "unfinished" result for every item that has none, in workload order."""
    have = {r.id: r for r in results}
    return [have.get(it.id) or _not_run(it, "unfinished") for it in items]


def summarize(engine: Engine, items: list[WorkItem], results: list[RequestResult], timeline: list,
              seconds: float, status: str = "done") -> dict[str, Any]:
    generated = sum(len(r.output) for r in results)
    if engine.events is not None:  # its publisher thread counts a batch's events as it builds it
        engine.events.sync(1.0)
    return {
        "status": status,
        "states": _states(results),
        "requests": sum(r.state == "finished" for r in results),
        "prompt_tokens": sum(len(it.prompt) for it in items),
        "generated_tokens": generated,
        "seconds": seconds,
        "tokens_per_s": generated / seconds if seconds > 0 else 0.0,
        # when the last token was sampled: what comes after is write-behind copies draining
        "last_token_s": next((row[0] for row in timeline if row[2] >= generated), seconds),
        **counters(engine),
        "timeline": timeline,
    }


def _states(results: list[RequestResult]) -> dict[str, int]:
    states = {s: 0 for s in ("finished", "aborted", "rejected", "unfinished")}
    for r in results:
        states[r.state] += 1
    return states


def write_outputs(out_dir: str | Path, results: list[RequestResult], summary: dict[str, Any]) -> None:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # NaN (no token sampled) is not JSON: write null.
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.to_json().items()}
            for r in results]
    (out / "results.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    (out / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")


def write_missing(out_dir: str | Path, workload_path: str | Path, status: str) -> bool:
    """The supervisor's side of "always a summary": when the engine wrote no summary.json
    (killed, or never started), write one with ``status``, and a results.jsonl keeping the
    lines the engine did write and listing every other request as unfinished. Returns
    whether it wrote them."""
    out = Path(out_dir)
    if (out / "summary.json").exists():
        return False
    items = read_workload(workload_path)
    results = []
    if (out / "results.jsonl").exists():
        known = RequestResult._fields
        for line in (out / "results.jsonl").read_text().splitlines():
            try:
                row = json.loads(line)
                results.append(RequestResult(**{k: row[k] for k in known if k in row}))
            except (ValueError, TypeError):
                continue  # a line cut short by the kill: that request is unfinished
    results = complete(items, results)
    write_outputs(out, results, {
        "status": status, "states": _states(results), "requests": sum(r.state == "finished" for r in results),
        "prompt_tokens": sum(len(it.prompt) for it in items),
        "generated_tokens": sum(len(r.output) for r in results), "seconds": 0.0, "tokens_per_s": 0.0,
        # what the engine measures is unknown: zeros, so a report of what finished can still be made
        "recomputed_tokens": 0, "preemptions": dict.fromkeys(("recompute", "offload", "storage"), 0),
        "hit_ratio": dict.fromkeys(("device", "host", "storage"), 0.0), "copy_gbps": 0.0, "step_ms_p50": 0.0,
        "step_ms_p99": 0.0, "task_ms_p50": 0.0, "measured": False,
        "timeline": []})
    return True


def serve_workload(spec: RunSpec, workload_path: str | Path, client_factory: Callable | None = None,
                   check: bool = False) -> int:
    """The engine process's body (``client_factory``, ``check``: see ``Engine``)."""
    items = read_workload(workload_path)
    if spec.role == "prefill":  # it computes each prompt (and samples once) for a decode engine
        items = [it._replace(max_new_tokens=1) for it in items]
    cpu_policy = apply_cpu_policy(spec.engine_cpu_policy)  # before Engine starts its threads: they inherit it
    engine = Engine.attach(spec, client_factory, check=check)
    results: list[RequestResult] = []
    timeline: list[list[float]] = [[0.0, 0, 0, 0]]
    status, code, start = "done", 0, time.monotonic()
    print(f"fastkv engine: run {spec.run_id}, role {spec.role}, {len(items)} requests from {workload_path}; "
          f"{spec.tp_size} rank(s), {spec.runner} runner, {spec.num_device_blocks} device / {spec.num_host_blocks} "
          f"host blocks, cache policy {spec.cache_policy}, storage {spec.storage_url or 'none'}",
          file=sys.stderr, flush=True)
    try:
        port = engine.metrics.serve(spec.metrics_port)
        if port:
            print(f"fastkv engine: metrics on http://127.0.0.1:{port}/metrics", file=sys.stderr, flush=True)
        engine.ends.signals["engine.total"] = len(items)
        engine.wait_until_ready()
        engine.ends.signals["engine.ready"] = READY
        start = time.monotonic()
        if spec.role == "decode":
            drive_decode(engine, items, results, timeline)
        else:
            drive(engine, items, results, timeline)
    except EngineStopped:
        status = "stopped"
    except EngineError as exc:
        print(f"fastkv engine: {exc}", file=sys.stderr, flush=True)
        status, code = f"failed: {exc}", 1
    except BaseException as exc:  # a bug: the traceback goes to the log, the summary says so
        status, code = f"failed: {type(exc).__name__}: {exc}", 1
        raise
    finally:
        try:  # the summary reads the run's signals: before the ends close
            engine.ends.signals["engine.ready"] = EXITING
            results = complete(items, results + engine.unfinished())
            seconds = time.monotonic() - start
            timeline.append(point(engine, sum(r.state == "finished" for r in results), seconds))
            if status == "done" and any(r.state == "unfinished" for r in results):
                status = "stopped"  # drive() returns early only on stop
            summary = summarize(engine, items, results, timeline, seconds, status)
            summary["engine_cpu_policy"] = cpu_policy
            if engine.exporter is not None:  # a decode run following the file ends with it
                engine.exporter.stream.end(status)
            handoff = engine.exporter.stats if engine.exporter is not None else engine.handoff_stats
            if handoff is not None:  # what the prefill -> decode handoff moved (fastkv.engine.handoff)
                summary["handoff"] = handoff.to_json()
            write_outputs(spec.out_dir, results, summary)
            engine.metrics.freeze()
            engine.metrics.write_textfile(Path(spec.out_dir) / "metrics.prom")
            print(f"fastkv engine: {status}: {summary['requests']} of {len(items)} requests finished in "
                  f"{seconds:.2f} s", file=sys.stderr, flush=True)
            # the final scrape window: a Prometheus scraping every few seconds sees the end
            engine.metrics.linger(spec.metrics_linger_s, engine.beat, lambda: engine.ends.signals["stop"])
        finally:
            engine.close()
    return code


def main(spec_json: str, workload_path: str) -> int:
    return serve_workload(RunSpec.from_json(spec_json), workload_path)

"""``fastkv-supervisor``: run a workload through fastkv and write its report.

    fastkv-supervisor                                  # the demo, CPU, LMDB, under memory pressure
    fastkv-supervisor --config job.toml --tp 2 --preemption recompute --workload trace:64
    fastkv-supervisor --cleanup                        # remove what crashed runs left in /dev/shm

This module is the run: the job prepared, stop signals held until the supervisor's own handlers
are in, the supervisor (``supervisor.py``) started, its outcome printed and the report written
(``report.py``). The settings and their precedence (flag > config file > default) are
``job.py``'s, the flags ``args.py``'s, the output directory's lock ``outdir.py``'s.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import secrets
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

from fastkv.cli.args import _flags, at_least, build_parser, parse_entries
from fastkv.cli.job import (
    AUTO_DEVICE_BYTES,
    CACHE_POLICIES,
    QUICK_DEMO,
    RUNNER_VOCAB,
    RUNNERS,
    STORAGE_WRITES,
    JobConfig,
    TableError,
    in_file,
    read_config_file,
)
from fastkv.cli.outdir import OutDir
from fastkv.native.compiled import NotBuilt

__all__ = ["AUTO_DEVICE_BYTES", "CACHE_POLICIES", "QUICK_DEMO", "RUNNER_VOCAB", "RUNNERS", "STORAGE_WRITES",
           "JobConfig", "TableError", "at_least", "build_parser", "cleanup", "in_file", "main", "parse_entries",
           "prepare", "read_config_file"]


def cleanup(run_id: str | None) -> int:
    from fastkv.ipc import cleanup as cleanup_run
    from fastkv.ipc import cleanup_stale

    removed = cleanup_run(run_id) if run_id else cleanup_stale()
    print(f"fastkv-supervisor: removed {len(removed)} shared-memory objects" + (f" of run {run_id}" if run_id else ""))
    for name in removed:
        print(f"  {name}")
    return 0


def prepare(cfg: JobConfig, run_id: str | None = None, outdir: OutDir | None = None):
    """Output directory, workload.jsonl and spec.json of a job; returns (spec, workload path).
    ``outdir``: ``cfg.out`` as claimed by the caller for run ``outdir.run_id``, held for the
    run; without one it is claimed for the preparation only (tests, benchmarks), for run
    ``run_id`` (default: a fresh id)."""
    from fastkv.workload import write_workload

    if outdir is None:
        with OutDir.claim(cfg.out, run_id or secrets.token_hex(4)) as held:
            return prepare(cfg, outdir=held)
    outdir.clear_previous()
    if cfg.storage == "default" and cfg.storage_url(outdir.path):
        outdir.fresh_store()  # runs start empty, so they are comparable
    workload = write_workload(cfg.requests(), outdir.path / "workload.jsonl", cfg.preemption)
    spec = cfg.to_spec(outdir.run_id, outdir.path)
    spec.save(outdir.path / "spec.json")
    return spec, workload


class _Progress:
    def __init__(self, enabled: bool) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=None, unit="req", desc="fastkv", disable=not enabled, dynamic_ncols=True)

    def __call__(self, finished: int, total: int) -> None:
        if (total or None) != self.bar.total or finished != self.bar.n:
            self.bar.total = total or None
            self.bar.n = finished
            self.bar.refresh()

    def close(self) -> None:
        self.bar.close()


class _Interrupted(KeyboardInterrupt):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signal = signal.Signals(signum)


_caught: int | None = None  # the start-up's stop signal, also when what it raised was swallowed


def _interrupted(signum: int, _frame: Any) -> None:
    # Raising from a handler is how a long start-up step (a pool starting, a probe) is cut short,
    # but whatever runs at that moment may swallow it (a __del__, a library's bare except): the
    # signal is recorded first, and the hand-over to the supervisor honours it.
    global _caught
    _caught = _caught or signum
    raise _Interrupted(signum)


def _hand_over(sup: Any) -> None:
    """From here a stop signal asks ``sup`` to stop (what its own handlers do once it runs), and
    one that came during the start-up and was lost on the way stops it before anything starts."""
    def stop(signum: int, _frame: Any) -> None:
        sup.request_stop(f"interrupted by {signal.Signals(signum).name}")

    for signum in (signal.SIGINT, signal.SIGTERM):
        signal.signal(signum, stop)
    if _caught is not None:
        sup.request_stop(f"interrupted by {signal.Signals(_caught).name}")


def _config_error(parser: argparse.ArgumentParser, exc: Exception) -> NoReturn:
    parser.exit(2, f"{parser.prog}: error: {exc}\n")  # one line: the usage is no help here


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.cleanup:
            return cleanup(args.run_id)
        roles = parse_entries(args.entry)
        cfg = JobConfig.from_sources(args.config, _flags(args))
        if "worker" not in roles:
            with in_file(args.config):
                cfg.check_runner_options()
        # All before anything is written: a live run's directory or namespace is not ours, and
        # a busy port would only fail the engine once everything had started.
        from fastkv.engine.metrics import check_port

        check_port(cfg.metrics_port)
        if cfg.kv_events():
            from fastkv.events.config import EventsConfig

            EventsConfig(**cfg.kv_events()).check_endpoints()
        run_id = _new_run_id(args.run_id)
        outdir = OutDir.claim(cfg.out, run_id)
    except (ValueError, NotBuilt) as exc:
        _config_error(parser, exc)
    with outdir:  # held until the run is over: a second run on this --out is refused
        return _prepare_and_run(parser, args, cfg, roles, outdir)


def _new_run_id(requested: str | None) -> str:
    from fastkv.ipc import Namespace, list_runs

    if requested is None:
        return secrets.token_hex(4)
    Namespace.attach(requested)  # checks the name
    for run in list_runs():
        if run.run_id == requested and run.alive:
            raise ValueError(f"--run-id {requested} is in use by a live run (pid {run.owner_pid})")
    return requested


def _prepare_and_run(parser: argparse.ArgumentParser, args: argparse.Namespace, cfg: JobConfig,
                     entries: dict[str, str], outdir: OutDir) -> int:
    from fastkv.engine.engine import write_missing
    from fastkv.transfer.tiers import _cuda_available

    # Importing Paddle replaces the C-level SIGTERM handler with one that exits at once (in any
    # thread); so first Paddle, while nothing of the run exists, then our handlers. Until the
    # supervisor's own go in, a signal unwinds the start-up and the run ends as stopped.
    global _caught
    _cuda_available()
    _caught = None
    old_handlers = {signum: signal.signal(signum, _interrupted) for signum in (signal.SIGINT, signal.SIGTERM)}
    pool = None  # mooncake://local: the run's own Mooncake pool
    try:
        # held back by fastkv.__main__ until now (a no-op otherwise); one that came meanwhile lands here
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
        try:
            spec, workload = prepare(cfg, outdir=outdir)
            pool = _local_pool(spec.storage_url)
            if pool is not None:
                spec = dataclasses.replace(spec, storage_url=pool.url)
            if spec.storage_url:  # a tier that cannot open would only be logged by the transfer processes
                from fastkv.storage import probe_store

                probe_store(spec.storage_url, spec.tp_size)
        except ValueError as exc:
            _config_error(parser, exc)
        # frames of a progress bar only to a terminal: a log file would keep every one
        return _run(cfg, spec, workload, entries, not args.no_progress and sys.stderr.isatty())
    except _Interrupted as exc:
        # prepare() may have written the workload (atomically) and not returned yet: the file,
        # once the previous run's are gone, says whether this run owes a summary
        wrote = outdir.cleared and (outdir.path / "workload.jsonl").is_file()
        if wrote:
            write_missing(outdir.path, outdir.path / "workload.jsonl", "stopped")
        print(f"fastkv-supervisor: stopped by {exc.signal.name} before the run started"
              + (f"; every request is listed unfinished in {outdir.path / 'results.jsonl'}" if wrote else ""),
              file=sys.stderr)
        return 128 + exc.signal
    finally:
        if pool is not None:
            pool.stop()
        for signum, handler in old_handlers.items():
            signal.signal(signum, handler)


def _local_pool(url: str):
    """``mooncake://local[?segment_size=4G]``: a Mooncake master and holder on 127.0.0.1 for
    this run, started (and stopped) by the supervisor; None for any other URL."""
    if not url.startswith("mooncake://local"):
        return None
    from fastkv.storage.local_mooncake import LocalMooncake

    pool = LocalMooncake.from_url(url)
    try:
        pool.start()
    except (OSError, RuntimeError) as exc:
        why = str(exc).splitlines()[0]
        raise ValueError(f"--storage {url}: the local Mooncake pool did not start: {why}") from None
    return pool


def _run(cfg: JobConfig, spec, workload: Path, entries: dict[str, str], progress_bar: bool) -> int:
    from fastkv.cli import report
    from fastkv.cli.supervisor import Supervisor
    from fastkv.procs.proctitle import set_title

    set_title("supervisor", None, spec.run_id)
    print(f"fastkv-supervisor: run {spec.run_id}: {spec.tp_size} rank(s), {cfg.runner} runner, "
          f"preemption {cfg.preemption}, {spec.num_device_blocks} device / {spec.num_host_blocks} host blocks, "
          f"storage {spec.storage_url or 'none'}; output in {spec.out_dir}", file=sys.stderr)
    for note in getattr(cfg, "overridden", []):
        print(f"fastkv-supervisor: {note}", file=sys.stderr)
    if spec.group_blocks:  # the device (and host) tier's blocks per KV cache group
        host = spec.host_group_blocks() or (0,) * len(spec.group_blocks)
        groups = ", ".join(f"{n} blocks of {len(g.layers)} layer(s) " + (f"sliding {g.window}" if g.window else "full")
                           + (f" ({h} host)" if h else "")
                           for g, n, h in zip(spec.layout.groups, spec.group_blocks, host, strict=True))
        print(f"fastkv-supervisor: KV cache groups: {groups}", file=sys.stderr)
    if getattr(cfg, "groups_note", ""):
        print(f"fastkv-supervisor: {cfg.groups_note}", file=sys.stderr)
    progress = _Progress(progress_bar)
    try:
        sup = Supervisor(spec, workload, entry_points=entries, progress=progress)
        _hand_over(sup)
        result = sup.run()
    finally:
        progress.close()
    code = 0 if result.ok else 130 if "SIGINT" in result.message else 143 if "SIGTERM" in result.message else 1
    stopped_by = result.message.removeprefix("interrupted by ") if result.message.startswith("interrupted by ") else ""
    out = Path(spec.out_dir)
    if not result.ok and not (stopped_by and (out / "summary.json").is_file()):
        print(f"fastkv-supervisor: run failed: {result.message}", file=sys.stderr)
        return code
    if stopped_by == "SIGTERM":  # an orchestrator's stop: no time spent drawing a report
        done = json.loads((out / "summary.json").read_text())
        print(f"fastkv-supervisor: stopped by SIGTERM after {done['requests']} of {sum(done['states'].values())} "
              f"requests; summary: {out / 'summary.json'}, results: {out / 'results.jsonl'}, logs: {out / 'logs'}",
              file=sys.stderr)
        return code
    # a stopped run's report covers the requests that finished
    rep = report.write(spec.out_dir, title=report.title(cfg.role, cfg.workload, cfg.preemption))
    print(rep.table)
    if faults := report.storage_faults(rep.data):  # the run degraded to recompute: say so, not only in a log
        print(f"fastkv-supervisor: warning: storage tier {spec.storage_url} failed during the run: {faults} "
              f"(see {spec.out_dir}/logs)", file=sys.stderr)
    if behind := report.storage_behind(rep.data):  # the pool silently misses what the run computed
        print(f"fastkv-supervisor: warning: storage tier {spec.storage_url} fell behind: {behind} "
              f"(--storage-backlog-blocks {spec.storage_backlog_blocks})", file=sys.stderr)
    print(f"report:  {rep.json_path}\nplot:    {rep.png_path}\nresults: {out / 'results.jsonl'}\n"
          f"logs:    {out / 'logs'}")
    if stopped_by:
        done, total = rep.data["requests"], sum(rep.data.get("states", {}).values())
        print(f"fastkv-supervisor: stopped by {stopped_by} after {done} of {total} requests", file=sys.stderr)
    return code




if __name__ == "__main__":
    sys.exit(main())

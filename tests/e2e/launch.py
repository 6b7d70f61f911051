"""A small supervisor for the end-to-end tests: real processes, real shared memory.

``Run(spec, workload)`` creates the namespace, the channels (``create_run``) and both KV
tiers of every rank, spawns transfer[r], worker[r] and the engine with multiprocessing
'spawn' (``engine=False``: no engine process, the test attaches one itself), and on
``close()`` stops them and unlinks everything (asserting that nothing of the run is left in
/dev/shm).
"""
from __future__ import annotations

import importlib
import json
import multiprocessing as mp
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from fastkv.ipc import Namespace, SignalArray
from fastkv.run import RunSpec, create_run
from fastkv.transfer.tiers import DeviceTier, HostTier

_CTX = mp.get_context("spawn")
TRANSFER = "fastkv.transfer.process:main"


def entry(target: str, *args: Any) -> None:
    """Process body: ``module:function(*args)``, its return value as the exit status."""
    module, fn = target.split(":")
    sys.exit(getattr(importlib.import_module(module), fn)(*args))


def engine_main(spec_json: str, workload_path: str) -> int:
    """The engine process, with check_integrity of scheduler and cache after every step."""
    from fastkv.engine.engine import serve_workload

    return serve_workload(RunSpec.from_json(spec_json), workload_path, check=True)


def new_run_id() -> str:
    return "e2e" + uuid.uuid4().hex[:8]


class Run:
    def __init__(self, spec: RunSpec, workload: list[dict], engine: bool = True, transfer: str = TRANSFER) -> None:
        self.spec = spec
        self.transfer = transfer  # entry point of the transfer processes
        self.workload = workload
        self.engine = engine
        self.out = Path(spec.out_dir)
        self.ns: Namespace | None = None
        self.sig: SignalArray | None = None
        self.tiers: list[Any] = []
        self.procs: dict[str, Any] = {}

    def __enter__(self) -> Run:
        try:
            self.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def start(self) -> None:
        spec = self.spec
        self.ns = Namespace.create(spec.run_id)
        create_run(self.ns, spec)
        self.sig = SignalArray.attach(self.ns, "signals")
        for r in range(spec.tp_size):
            self.ns.record("shm", f"kvdev{r}")
            self.tiers.append(DeviceTier.create(spec.tier_prefix, r, spec.layout, spec.num_device_blocks,
                                                backend="shm", layer_blocks=spec.layer_blocks()))
            for g, layout, n in spec.host_tiers():  # a hybrid's: a segment per KV cache group
                self.ns.record("shm", f"kvhost{r}" + ("" if g is None else f"g{g}"))
                self.tiers.append(HostTier.create(spec.tier_prefix, r, layout, n, group=g))
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / "workload.jsonl"
        path.write_text("".join(json.dumps(w) + "\n" for w in self.workload))
        text = spec.to_json()
        for r in range(spec.tp_size):
            self._spawn(f"transfer{r}", self.transfer, text, r)
            self._spawn(f"worker{r}", "fastkv.engine.worker:main", text, r)
        if self.engine:
            self._spawn("engine", "tests.e2e.launch:engine_main", text, str(path))

    def wait_ready(self, names: list[str], timeout: float = 120.0) -> None:
        """(Test code: polls.) Until every process named has said ready."""
        deadline = time.monotonic() + timeout
        while not all(self.sig[f"{n}.ready"] for n in names):
            dead = [n for n in names if self.procs[n].exitcode is not None]
            assert not dead, f"{dead} exited during start-up: {[self.procs[n].exitcode for n in dead]}"
            assert time.monotonic() < deadline, f"{names} not ready within {timeout} s"
            time.sleep(0.02)

    def _spawn(self, name: str, target: str, *args: Any) -> None:
        p = _CTX.Process(target=entry, args=(target, *args), name=name, daemon=True)
        p.start()
        self.procs[name] = p

    def wait(self, timeout: float) -> int:
        """The engine's exit status; AssertionError (with every process's status) if it hangs."""
        engine = self.procs["engine"]
        engine.join(timeout)
        if engine.is_alive():
            state = {n: (p.pid, p.exitcode) for n, p in self.procs.items()}
            raise AssertionError(f"engine still running after {timeout} s: {state}, signals {self.sig.snapshot()}")
        return engine.exitcode

    def kill(self, name: str) -> None:
        p = self.procs[name]
        p.kill()
        p.join(10)

    def restart_transfer(self, rank: int) -> None:
        """What the supervisor does when transfer[rank] died: bump its generation, start a new one."""
        self.sig.add(f"transfer{rank}.gen", 1)
        self._spawn(f"transfer{rank}", self.transfer, self.spec.to_json(), rank)

    def results(self) -> dict[str, dict]:
        rows = [json.loads(line) for line in (self.out / "results.jsonl").read_text().splitlines()]
        return {row["id"]: row for row in rows}

    def summary(self) -> dict:
        return json.loads((self.out / "summary.json").read_text())

    def close(self) -> dict[str, int | None]:
        """Stop everything, then unlink everything; returns the exit status of each process."""
        if self.sig is not None:
            self.sig["stop"] = 1
        codes = {}
        for name, p in self.procs.items():
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(10)
            codes[name] = p.exitcode
        for tier in self.tiers:
            tier.close()
            tier.unlink()
        self.tiers = []
        if self.sig is not None:
            self.sig.close()
            self.sig = None
        if self.ns is not None:
            self.ns.close()
            self.ns = None
        left = sorted(p.name for p in Path("/dev/shm").glob(f"*fkv*{self.spec.run_id}*"))
        assert not left, f"run {self.spec.run_id} left shared memory behind: {left}"
        return codes

"""The worker process of one tensor-parallel rank: plan in, model step, output out.

``main(spec_json, rank)`` attaches the run's channels and the rank's device tier (created
by the supervisor on a CPU build, allocated here and shared by CUDA IPC on a GPU build; the
transfer process of the same rank reads and writes the same memory), builds the runner
named by ``spec.runner`` and loops:

1. wait for a ``PlanMsg`` on ``plan.{rank}`` (blocking, timeout ``heartbeat_s``: beat, look
   at ``stop``, wait again);
2. ``runner.step`` on it (a runner that is not ``layerwise`` first waits for the layered
   host -> device copies the plan names, whole: ``fastkv.ipc.landed``), its placeholders
   filled in with this rank's tokens of the step before (async scheduling:
   ``protocol.fill_placeholders``); forget the requests the plan releases;
3. with tp > 1, every rank joins one all-gather of its error text (empty when fine) on the
   run's ``ShmCollective``: rank 0 answers only after every rank has written the step's
   KV. Without that, a copy the engine plans right after rank 0's answer could read a block
   rank r is still writing (DESIGN.md invariant 3), and a rank's failure would go unseen;
4. rank 0 sends the ``OutputMsg``: sampled tokens, or ``error`` naming the ranks that
   failed and why (the engine fails the run loudly; never a silent death).

A control plan (``protocol.weights_request``) is the weight-update hook, sent once the
transfer processes have cleared (they hold no copy in flight and no mapping of a CUDA tier):
the runner loads the new weights; with ``free_memory`` the device tier's memory goes first
(shm: ``DeviceTier.release``, the pages return as zeros when written; CUDA: every reference
dropped, the allocator's cache emptied, the tier allocated again under the same name for
RESTORE to attach). The ranks agree on it as on a step, so rank 0 acks when all are done.

Exit 0 on ``stop`` or when the engine closed the plan channel (its clean shutdown); 1 when
the engine died, a peer rank vanished mid-step, or the runner could not be built.
"""
from __future__ import annotations

import inspect
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import numpy as np

from fastkv.engine import protocol
from fastkv.engine.runners import runner_class
from fastkv.ipc import ChannelClosed, Namespace, OutputMsg, PeerDied, pid_alive
from fastkv.ipc.collective import ShmCollective
from fastkv.ipc.landed import Landed
from fastkv.kernels import ops
from fastkv.run import EXITING, READY, RunSpec, attach_worker, collective_prefix
from fastkv.transfer.tiers import DeviceTier, TierKind, resident_bytes, select_device

_ERROR_BYTES = 256  # per rank, in the end-of-step agreement


def _check_peer(sig, rank: int, peer: int) -> None:
    """Between slices of a collective wait: beat (waiting for a peer is no hang), and end the
    wait at once on a dead peer worker or a stop."""
    sig[f"worker{rank}.beat"] = time.monotonic_ns()
    pid = sig[f"worker{peer}.pid"]
    if pid and not pid_alive(pid):
        raise TimeoutError(f"worker{peer} (pid {pid}) died")
    if sig["stop"]:
        raise TimeoutError(f"stop requested while waiting for worker{peer}")


def runner_options(spec: RunSpec, rank: int, sig) -> tuple[dict[str, Any], ShmCollective | None]:
    """``spec.runner_options`` as the runner's keyword arguments (JSON dicts -> config
    objects), plus the tp group's collective when the runner takes one."""
    cls = runner_class(spec.runner)
    opts = dict(spec.runner_options)
    if spec.runner == "tiny" and isinstance(opts.get("config"), dict):
        from fastkv.engine.runners.tiny_decoder import TinyConfig

        opts["config"] = TinyConfig(**opts["config"])
    if "weights_version" in inspect.signature(cls).parameters:
        opts.setdefault("weights_version", spec.weights_version)
    coll = None
    if spec.tp_size > 1:  # every worker uses it at the end of each step (``_agree``)
        coll = ShmCollective.attach(collective_prefix(spec), rank, timeout_s=spec.task_timeout_s,
                                    slice_s=spec.heartbeat_s, check=lambda peer: _check_peer(sig, rank, peer))
        if "collective" in inspect.signature(cls).parameters:
            opts["collective"] = coll
    return opts, coll


def _device_tier(spec: RunSpec, rank: int) -> DeviceTier:
    """CPU build: the supervisor created the tier in shm, attach it. GPU build: allocate it
    here and publish its CUDA IPC handles under the name the supervisor listed in the run's
    manifest (the transfer process of this rank attaches it; the supervisor unlinks it)."""
    if select_device(spec.device_id(rank)):
        return DeviceTier.create(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks, backend="cuda",
                                 layer_blocks=spec.layer_blocks())
    return DeviceTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks, populate=True,
                             layer_blocks=spec.layer_blocks())


def main(spec_json: str, rank: int) -> int:
    ops.default_fatal_signals()
    spec = RunSpec.from_json(spec_json)
    me = f"worker{rank}"
    ns = Namespace.attach(spec.run_id)
    ends = attach_worker(ns, spec, rank)
    sig = ends.signals
    sig[f"{me}.pid"] = os.getpid()
    sig[f"{me}.beat"] = time.monotonic_ns()
    tier = coll = runner = landed = None
    try:
        landed = Landed.attach(ns, sig, rank, spec.layout.num_layers)
        tier = _device_tier(spec, rank)
        opts, coll = runner_options(spec, rank, sig)
        # Shared-memory tier: hand the runner numpy views (zero-copy; every reference runner takes
        # them, and Paddle's DLPack cannot export a CPU bfloat16 tensor to numpy). CUDA: the tensors.
        k, v = (tier.k_arrays, tier.v_arrays) if tier.k_arrays else (tier.k, tier.v)
        runner = runner_class(spec.runner)(spec.layout, rank, spec.tp_size, k, v, **opts)
        sig[f"{me}.ready"] = READY

        def load_weights(req: protocol.LoadWeights) -> None:
            nonlocal tier
            tier, released = _load_weights(spec, rank, tier, runner, req)
            sig.add(f"{me}.released_bytes", released)
        waiter = landed.waiter(spec.task_timeout_s, lambda: sig.__setitem__(f"{me}.beat", time.monotonic_ns()),
                               spec.heartbeat_s)
        runner.bind_layer_wait(waiter)
        return _loop(spec, rank, ends, runner, coll, load_weights, waiter)
    except Exception:
        print(f"fastkv {me}: fatal error\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        return 1
    finally:
        sig[f"{me}.ready"] = EXITING
        if runner is not None:
            runner.close()
        if coll is not None:
            coll.close()
        if tier is not None:
            tier.close()
        if landed is not None:
            landed.close()
        ends.close()


def _load_weights(spec: RunSpec, rank: int, tier: DeviceTier, runner,
                  req: protocol.LoadWeights) -> tuple[DeviceTier, int]:
    """The weight-update hook on one rank (module docstring); returns the rank's device tier
    and the bytes of memory it gave back meanwhile."""
    if not req.free_memory:
        runner.load_weights(req.version)
        return tier, 0
    if tier.kind is TierKind.DEVICE_SHM:
        held = tier.release()
        released = held - resident_bytes(tier.name)  # measured before the new weights touch anything
        runner.load_weights(req.version)
        return tier, released
    import paddle

    held = paddle.device.cuda.memory_reserved()
    runner.drop_caches()
    tier.close()
    tier.unlink()
    paddle.device.cuda.empty_cache()
    released = held - paddle.device.cuda.memory_reserved()
    runner.load_weights(req.version)
    tier = _device_tier(spec, rank)
    runner.set_caches(tier.k, tier.v)
    return tier, released


def _agree(coll: ShmCollective | None, error: str) -> str:
    """End of a step on every rank (tp > 1): nobody answers before every rank has written its
    KV (rank 0's output lets the engine plan copies that read those blocks), and every rank
    learns every rank's error."""
    if coll is None:
        return error
    buf = np.zeros(_ERROR_BYTES, np.uint8)
    text = error.encode()[:_ERROR_BYTES]
    buf[: len(text)] = np.frombuffer(text, np.uint8)
    parts = coll.all_gather(buf)
    return "; ".join(bytes(p).rstrip(b"\0").decode(errors="replace") for p in parts if p.any())


def _loop(spec: RunSpec, rank: int, ends, runner, coll: ShmCollective | None,
          load_weights: Callable[[protocol.LoadWeights], None], wait_layer: Callable[[int, int], float]) -> int:
    me, sig = f"worker{rank}", ends.signals
    beat = f"{me}.beat"
    last: dict[int, int] = {}  # sampled in the last step: the next plan's placeholders (protocol)
    while True:
        sig[beat] = time.monotonic_ns()
        try:
            msg = ends.plan.recv(timeout=spec.heartbeat_s)
        except ChannelClosed:
            return 0  # the engine finished and closed its end
        except PeerDied as exc:
            print(f"fastkv {me}: {exc}; exiting", file=sys.stderr, flush=True)
            return 1
        if msg is None:
            if sig["stop"]:  # only between plans: the other ranks must not wait for us mid-step
                return 0
            continue
        error, reply = "", None
        try:
            if msg.control:
                load_weights(protocol.weights_request(msg))
                reply = OutputMsg(msg.step_id)
            else:
                plan = protocol.fill_placeholders(protocol.msg_to_plan(msg, len(spec.layout.groups), rank), last)
                if plan.wait_landed and not runner.layerwise:  # its copies whole, before the step
                    wait_layer(plan.wait_landed, spec.layout.num_layers - 1)
                out = runner.step(plan)
                if plan.seqs:
                    last = out.sampled
                reply = protocol.output_to_msg(out, sum(len(t) for t in msg.token_ids))
        except Exception as exc:  # reported to the engine, which fails the run loudly
            what = "loading weights" if msg.control else f"step {msg.step_id}"
            error = f"{me} {what}: {type(exc).__name__}: {exc}"
            print(f"fastkv {error}\n{traceback.format_exc()}", file=sys.stderr, flush=True)
        for name, value in runner.checks().items():  # before the output: the engine reads them after the last step
            sig[f"{me}.{name}"] = value
        try:
            error = _agree(coll, error)
        except TimeoutError as exc:  # a peer rank is gone or stuck
            error = f"{me} step {msg.step_id}: {exc}"
            if ends.output is None:
                print(f"fastkv {error}; exiting", file=sys.stderr, flush=True)
                return 1
        if msg.release:
            runner.release(protocol.released(msg))
        if ends.output is None:
            continue
        try:
            ends.output.send(protocol.error_msg(msg.step_id, error) if error else reply, timeout=spec.dead_after_s)
        except ChannelClosed:
            return 0
        except PeerDied as exc:
            print(f"fastkv {me}: {exc}; exiting", file=sys.stderr, flush=True)
            return 1

"""The worker contract: what a deployment's own model worker does for fastkv (docs/WORKER_API.md).

One ``WorkerPort`` per tensor-parallel rank, in the deployment's worker process::

    port = WorkerPort(spec, rank)              # attaches the run the launch created
    tier = DeviceTier.attach(...) / .create(..., backend="cuda") / .adopt(...)
    port.ready()
    for plan in port.plans():                  # ends when the engine closes (or ``stop``)
        if plan.weights is not None:           # the weight-update hook
            model.load_weights(plan.weights.version)
            port.answer(plan)
            continue
        sampled = model.step(plan, tier)       # {request_id: token} for the seqs with .sample
        port.answer(plan, sampled)             # every rank; rank 0's goes to the engine
        model.forget(plan.release)             # finished requests: drop their per-request state
    port.close()

- ``Plan.seqs``: per request its caller's id (the one given to ``Engine.add_request``),
  ``token_ids`` (the tokens whose K/V this step computes, at positions ``start_pos`` ...),
  ``block_table`` (device block of each ``block_size`` positions), ``sample`` (sample a
  token after the last one) and ``sampling`` (``fastkv.engine.sampling.Sampling``, as given).
  Write each new token's K/V at ``k[layer][block_table[pos // block_size], :, pos %
  block_size]`` and nothing else: other slots may be in flight to another tier. A
  sliding-window hybrid layout (``KVLayout.windows``) has one table per KV cache group:
  ``block_table`` is [groups, blocks] and layer l uses row ``layout.group_of(l)`` (its K/V
  tensors have that group's block count); -1 marks a block the group no longer holds (before
  the window of the step's first query), which the layer must not read.
- Async scheduling: the engine sends a plan before the previous one's answer is in. A seq
  that decodes on the token its previous step samples arrives with that token filled in
  from the ``sampled`` this rank passed to ``answer``: so every rank passes its sampled
  tokens (at tp > 1 they must be the same on every rank, as greedy sampling of the same
  logits is). A deployment whose ranks > 0 do not sample runs ``--async-scheduling off``.
- Layer-wise loading: ``WorkerPort(..., layerwise=True)`` promises that the model calls
  ``port.wait_layer(plan, layer)`` before each layer writes or reads KV, so a step starts
  while the host -> device copies it needs still land layer by layer (``Plan.wait_landed``).
  Without it ``plans()`` waits for those copies whole before it yields the plan.
- ``Plan.release``: requests finished (or aborted) since the last plan; the engine also
  sends them in an empty plan when it idles, and before it closes.
- Heartbeats: ``plans()`` beats ``worker{r}.beat`` whenever it waits; a step longer than
  ``spec.dead_after_s`` must call ``port.beat()`` (the supervisor takes a silent worker
  for dead; an embedding deployment's engine watches only the pid).
- Shutdown: ``plans()`` ends when the engine closes its end (``Engine.close``) or ``stop``
  is set; ``EngineDied`` when the engine process died (exit non-zero: nobody else will
  answer the plans).
- End of step at tp > 1: ``answer`` is the agreement: every rank calls it, and rank 0 sends
  the output only after every rank has finished writing the step's K/V (an all-gather on
  fastkv's ``ShmCollective``; its error text reaches the engine). A deployment that has its
  own barrier (NCCL) passes ``agree=False`` and must barrier before rank 0 answers.
"""
from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from typing import NamedTuple

import numpy as np

from fastkv.engine import protocol
from fastkv.engine.sampling import Sampling
from fastkv.ipc import ChannelClosed, Namespace, OutputMsg, PeerDied
from fastkv.ipc.collective import ShmCollective
from fastkv.ipc.landed import Landed
from fastkv.run import EXITING, READY, RunSpec, attach_worker, collective_prefix


class EngineDied(RuntimeError):
    """The engine process died: the run is over."""


class Seq(NamedTuple):
    request_id: str  # the caller's id
    token_ids: np.ndarray  # the tokens to compute this step (read-only)
    start_pos: int  # position of token_ids[0]; the request's K/V below it is in place
    # device block of positions [i * block_size, (i + 1) * block_size); a sliding-window hybrid
    # layout: [groups, blocks], layer l's row ``layout.group_of(l)``, -1 where that group holds none
    block_table: np.ndarray
    sample: bool  # sample the next token after the last of token_ids (else a prefill chunk)
    sampling: Sampling


class Plan(NamedTuple):
    step_id: int  # 0: not a model step (start-up, releases, the weight-update hook)
    seqs: list[Seq]
    release: list[str]  # finished since the last plan: forget them
    weights: protocol.LoadWeights | None  # the weight-update hook: load these weights, then answer
    wait_landed: int = 0  # layer-wise loading: the layered copy this step's layers wait for (``wait_layer``)


class WorkerPort:
    """Rank ``rank``'s end of the worker contract (module docstring). ``agree``: run
    fastkv's end-of-step agreement at tp > 1 (False: the deployment barriers itself)."""

    def __init__(self, spec: RunSpec, rank: int, *, agree: bool = True, layerwise: bool = False) -> None:
        self.spec, self.rank = spec, rank
        self.layerwise = layerwise
        self.me = f"worker{rank}"
        self._ns = Namespace.attach(spec.run_id)
        self.ends = attach_worker(self._ns, spec, rank)
        self.signals = self.ends.signals
        self.signals[f"{self.me}.pid"] = os.getpid()
        self.beat()
        self._known: dict[str, tuple[str, Sampling]] = {}  # wire id -> the caller's id, its sampling
        self._coll: ShmCollective | None = None
        self._agree = agree
        if spec.tp_size > 1:
            from fastkv.engine.worker import _check_peer

            self._coll = ShmCollective.attach(collective_prefix(spec), rank, timeout_s=spec.task_timeout_s,
                                              slice_s=spec.heartbeat_s,
                                              check=lambda peer: _check_peer(self.signals, rank, peer))
        self._msg = None
        self._last: dict[str, int] = {}  # wire id -> token this rank sampled in the last step
        self._landed = Landed.attach(self._ns, self.signals, rank, spec.layout.num_layers)
        self._wait = self._landed.waiter(spec.task_timeout_s, self.beat, spec.heartbeat_s)

    def beat(self) -> None:
        self.signals[f"{self.me}.beat"] = time.monotonic_ns()

    def ready(self) -> None:
        """This rank is attached and its model built: the engine's start-up may go on."""
        self.signals[f"{self.me}.ready"] = READY

    def plans(self) -> Iterator[Plan]:
        """Each plan the engine sends, until it closes (or ``stop``); EngineDied if it died.
        Answer each one (``answer``) before taking the next."""
        while True:
            self.beat()
            try:
                msg = self.ends.plan.recv(timeout=self.spec.heartbeat_s)
            except ChannelClosed:
                return
            except PeerDied as exc:
                raise EngineDied(f"{self.me}: {exc}") from None
            if msg is None:
                if self.signals["stop"]:
                    return
                continue
            self._msg = msg
            plan = self._plan(msg)
            if plan.wait_landed and not self.layerwise:  # the copies whole, before the step
                self._wait(plan.wait_landed, self.spec.layout.num_layers - 1)
            yield plan

    def wait_layer(self, plan: Plan, layer: int) -> float:
        """Layer-wise loading (``WorkerPort(layerwise=True)``): blocks until layer ``layer``'s KV
        that ``plan`` reads has landed on this rank's device; call it before layer ``layer``
        writes or reads any KV. Returns the seconds waited (0 when nothing was in flight).
        TimeoutError when a copy is late past ``spec.task_timeout_s``."""
        if not plan.wait_landed:
            return 0.0
        return self._wait(plan.wait_landed, layer)

    def _plan(self, msg) -> Plan:
        if msg.control:
            return Plan(msg.step_id, [], [], protocol.weights_request(msg))
        for wire, params in zip(msg.request_ids, msg.params, strict=False):
            if params:
                doc = json.loads(params)
                self._known[wire] = (doc["id"], Sampling.from_json(doc["sampling"]))
        sample = msg.sample if len(msg.sample) else np.ones(len(msg.request_ids), np.int32)
        groups = len(self.spec.layout.groups)
        seqs = [Seq(self._known[wire][0], self._filled(msg.step_id, wire, tok), int(start),
                    table.reshape(groups, -1) if groups > 1 else table, bool(smp),
                    self._known[wire][1])
                for wire, tok, table, start, smp in zip(msg.request_ids, msg.token_ids, msg.block_tables,
                                                        msg.num_computed, sample, strict=True)]
        release = [self._known.pop(wire)[0] for wire in msg.release if wire in self._known]
        return Plan(msg.step_id, seqs, release, None,
                    int(msg.wait_landed[self.rank]) if len(msg.wait_landed) else 0)

    def _filled(self, step_id: int, wire: str, tok: np.ndarray) -> np.ndarray:
        """``tok``, its placeholder (async scheduling) replaced by this rank's last sample."""
        if len(tok) != 1 or tok[0] != protocol.PLACEHOLDER:
            return tok
        if wire not in self._last:
            raise ValueError(f"{self.me}: {protocol.placeholder_error(step_id, self._known[wire][0])}")
        return np.array([self._last[wire]], np.int32)

    def answer(self, plan: Plan, sampled: dict[str, int] | None = None, error: str = "", seconds: float = 0.0) -> None:
        """Ends ``plan`` on this rank: ``sampled`` maps the caller's id of every seq with
        ``sample`` to its token (rank 0's are the ones used); ``error`` fails the run with
        that text. At tp > 1 every rank calls it: nobody's answer leaves before every rank
        is done with the step."""
        msg, self._msg = self._msg, None
        if msg is None or msg.step_id != plan.step_id:
            raise ValueError(f"{self.me}: answer for step {plan.step_id}, which is not the plan in hand")
        if plan.seqs and not error:  # the next plan's placeholders are these tokens
            by_caller = {self._known[w][0]: w for w in msg.request_ids}
            self._last = {by_caller[i]: int(t) for i, t in (sampled or {}).items() if i in by_caller}
        if self._coll is not None and self._agree:
            from fastkv.engine.worker import _agree

            try:
                error = _agree(self._coll, error)
            except TimeoutError as exc:
                error = f"{self.me} step {msg.step_id}: {exc}"
        if self.ends.output is None:
            return
        if error:
            out = protocol.error_msg(msg.step_id, error)
        elif plan.weights is not None:
            out = OutputMsg(msg.step_id)
        else:
            by_id = {self._known[w][0]: w for w in msg.request_ids}
            sampled = sampled or {}
            missing = [s.request_id for s in plan.seqs if s.sample and s.request_id not in sampled]
            if missing:
                raise ValueError(f"{self.me}: no sampled token for {missing[:8]} in step {msg.step_id}")
            ids = [s.request_id for s in plan.seqs if s.sample]
            out = OutputMsg(msg.step_id, sum(len(t) for t in msg.token_ids), seconds, [by_id[i] for i in ids],
                            np.fromiter((int(sampled[i]) for i in ids), np.int32, len(ids)))
        try:
            self.ends.output.send(out, timeout=self.spec.dead_after_s)
        except ChannelClosed:
            return
        except PeerDied as exc:
            raise EngineDied(f"{self.me}: {exc}") from None

    # -- the tensor-parallel group's collective ---------------------------------------------
    def all_gather(self, arr: np.ndarray) -> list[np.ndarray]:
        """Every rank's ``arr`` (same shape and dtype on every rank), in rank order: fastkv's
        ``ShmCollective`` over shared memory, for a worker without a collective of its own (its
        own NCCL is faster on a GPU). Every rank calls the collectives in the same order (and
        ``answer`` is one too); a dead peer or a stop raises TimeoutError. At tp 1, ``[arr]``."""
        if self._coll is None:
            return [np.array(arr)]
        return self._coll.all_gather(arr)

    def all_reduce_sum(self, arr: np.ndarray) -> np.ndarray:
        """The sum of every rank's ``arr``, the same bits on every rank (added in rank order):
        a row-parallel layer's partial sums. At tp 1, a copy of ``arr``."""
        if self._coll is None:
            return np.array(arr)
        return self._coll.all_reduce_sum(arr)

    def close(self) -> None:
        self.signals[f"{self.me}.ready"] = EXITING
        if self._coll is not None:
            self._coll.close()
        self._landed.close()
        self.ends.close()
        self._ns.close()

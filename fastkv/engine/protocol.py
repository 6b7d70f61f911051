"""The worker protocol: a scheduler step on the wire and back.

The engine turns each ``StepPlan`` into one ``PlanMsg`` (the same bytes to every rank);
a worker turns it back into a ``StepPlan`` for its runner, and rank 0 answers with one
``OutputMsg``. A ``PlanMsg`` whose ``control`` is set is not a step but a request to every
rank: ``load_weights_msg`` is the weight-update hook (``weights_request`` reads it back;
rank 0 answers with an empty ``OutputMsg`` once every rank has loaded, or with the error).
Request ids are the scheduler's ints, sent as decimal strings; the caller's id and the
sampling parameters of each request come once, in ``PlanMsg.params`` of the first plan that
carries it (``fastkv.engine.worker_api`` maps them back). These functions are all a
deployment's own worker needs besides its model (see ``fastkv.engine.core`` for the
embedding example).

Async scheduling: the engine sends step N+1 before step N's output is in. A request that
samples in step N and decodes in step N+1 gets ``PLACEHOLDER`` (-1) as its input token there;
the worker fills it in with the token it sampled for that request in step N
(``fill_placeholders``), so every rank must keep its own sampled tokens of the last step.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from fastkv.ipc import OutputMsg, PlanMsg
from fastkv.sched.output import PLACEHOLDER, SeqWork, StepOutput, StepPlan


def plan_to_msg(plan: StepPlan, release: Iterable[int] = (), params: dict[int, str] | None = None) -> PlanMsg:
    """``params``: request id -> its JSON (``PlanMsg.params``) for the requests new to the workers."""
    seqs = plan.seqs
    sample = np.fromiter((s.sample for s in seqs), np.int32, len(seqs))
    return PlanMsg(
        plan.step_id,
        [str(s.request_id) for s in seqs],
        [s.token_ids for s in seqs],
        [s.block_table.reshape(-1) for s in seqs],  # a hybrid's [groups, blocks] goes row by row
        np.fromiter((s.start_pos for s in seqs), np.int32, len(seqs)),
        np.empty(0, np.int32) if sample.all() else sample,  # all-sample (decode) steps send no flags
        [str(r) for r in release],
        params=[params.get(s.request_id, "") for s in seqs] if params else [],
    )


def msg_to_plan(msg: PlanMsg, groups: int = 1, rank: int = 0) -> StepPlan:
    """Rank ``rank``'s StepPlan; arrays are the message's read-only views (runners only read them).
    ``groups``: the layout's KV cache groups; more than one, each table is [groups, blocks]."""
    n = len(msg.request_ids)
    sample = msg.sample if len(msg.sample) else np.ones(n, np.int32)
    return StepPlan(msg.step_id, [
        SeqWork(int(rid), tok, int(start), table.reshape(groups, -1) if groups > 1 else table, bool(smp))
        for rid, tok, table, start, smp in zip(msg.request_ids, msg.token_ids, msg.block_tables, msg.num_computed,
                                               sample, strict=True)
    ], int(msg.wait_landed[rank]) if len(msg.wait_landed) else 0)


def placeholder_error(step_id: int, request_id: object) -> str:
    return (f"step {step_id}: request {request_id} decodes on the token this rank sampled for it in the step "
            f"before, and it sampled none (every rank keeps its sampled tokens; or run with --async-scheduling off)")


def fill_placeholders(plan: StepPlan, last: dict[int, int]) -> StepPlan:
    """Async scheduling: a seq whose input token is ``PLACEHOLDER`` decodes on the token this
    rank sampled for it in the step before (``last``, that step's ``StepOutput.sampled``).
    Every rank fills it from its own sample, which tp keeps equal on every rank. ValueError
    (naming the step and request) when there is none."""
    for seq in plan.seqs:
        if len(seq.token_ids) == 1 and seq.token_ids[0] == PLACEHOLDER:
            tok = last.get(seq.request_id)
            if tok is None:
                raise ValueError(placeholder_error(plan.step_id, seq.request_id))
            seq.token_ids = np.array([tok], np.int32)
    return plan


def released(msg: PlanMsg) -> list[int]:
    return [int(r) for r in msg.release]


def output_to_msg(out: StepOutput, num_batched_tokens: int) -> OutputMsg:
    ids = list(out.sampled)
    return OutputMsg(out.step_id, num_batched_tokens, out.seconds, [str(r) for r in ids],
                     np.fromiter((out.sampled[r] for r in ids), np.int32, len(ids)))


def error_msg(step_id: int, error: str) -> OutputMsg:
    return OutputMsg(step_id, error=error or "unknown error")


def msg_to_output(msg: OutputMsg) -> StepOutput:
    return StepOutput(msg.step_id, {int(r): int(t) for r, t in zip(msg.request_ids, msg.tokens, strict=True)},
                      msg.seconds)


class LoadWeights(NamedTuple):
    version: str
    free_memory: bool  # release the device tier while the weights load, re-create it after


def load_weights_msg(version: str, free_memory: bool = False) -> PlanMsg:
    return PlanMsg(0, control=json.dumps({"load_weights": str(version), "free_memory": bool(free_memory)}))


def weights_request(msg: PlanMsg) -> LoadWeights:
    """The hook a control ``PlanMsg`` asks for (ValueError naming what is not understood)."""
    doc = json.loads(msg.control)
    if not isinstance(doc, dict) or not isinstance(doc.get("load_weights"), str):
        raise ValueError(f"unknown control request {msg.control[:200]!r}")
    return LoadWeights(doc["load_weights"], bool(doc.get("free_memory")))

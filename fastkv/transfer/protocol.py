"""What travels on a rank's task channel besides copy tasks, and the storage namespace.

Task channel ``task.{r}`` (engine -> transfer[r]) carries ``TaskMsg`` of two sorts:

* copy tasks: ``kind`` is a ``CopyKind`` (SWAP_OUT .. RESTORE), ``task_id`` the plan id;
* a FENCE: ``kind == FENCE`` (0), ``task_id == -1``,
  ``keys == (b"<pid>:<start time>", b"<weights version>")``, naming one transfer process
  and the weights version the engine serves now. The client sends it when it adopts that
  process as rank r's owner (see ``fastkv.transfer.client``); the process opens storage
  under that version before its first task, so a process restarted after a weight update
  (whose spec still names the first version) reads and writes the current namespace.

Why fences. A transfer process that dies leaves the tasks it had not yet taken in its
ring; the client fails every task pending on the dead rank, so those stale tasks must
never run (their blocks go back to the engine and may be reused). A process executes
nothing until it has read the fence addressed to it: everything before that fence was
sent to a predecessor and has been failed by the client, everything after it is its own.
This holds for any number of restarts and needs no shared counter; the first process of a
run waits for its fence as well (the client sends it on first contact).

Every process acknowledges each copy task it executes with exactly one ``DoneMsg``;
dropped stale tasks and fences get none.

Acks come in the order tasks finish, not the order they were sent: swaps and storage I/O
run in separate lanes (``fastkv.transfer.lanes``); the client matches each ack by task id.

A bad task message (a corrupt ring frame, bytes that do not decode) read after the
process's fence is acknowledged as failed with ``task_id == BAD_TASK_ID`` (its own id
cannot be trusted, and a dropped frame has none). The process treats it as a barrier:
it acks it only once every task read before it has been acked, and reads nothing after
it until then, so on the FIFO done ring that ack belongs to the oldest task the rank
still owes; the client fails just that task's share. Acks a dead predecessor left behind
are discarded when its successor is adopted, before its fence is sent.
"""
from __future__ import annotations

from fastkv.cache.plan import FREE as FREE  # CLEAR's only key on the wire: free_memory (executor.py)
from fastkv.cache.plan import CopyKind, Task, task_of, wire_fields
from fastkv.ipc import Peer, TaskMsg
from fastkv.run import RunSpec
from fastkv.storage import namespace_fingerprint

FENCE = 0  # TaskMsg.kind of a fence (CopyKind starts at 1)
FENCE_ID = -1
BAD_TASK_ID = -2  # DoneMsg.task_id of the ack of a task message that could not be read
REDO_IDS = -1000  # and down: layered copies a dead process left half done, redone by its successor


def task_msg(plan: Task, layered: int = 0) -> TaskMsg:
    """The task carrying ``plan`` (a copy plan or a control task) to every rank; ``layered``:
    a SWAP_IN's number among the layered ones (``TaskMsg.layered``)."""
    src, dst, keys = wire_fields(plan)
    return TaskMsg(plan.plan_id, int(plan.kind), src, dst, tuple(keys), layered)


KINDS = {int(kind): kind for kind in CopyKind}  # a dict look-up, where CopyKind(n) costs microseconds per task


def task_plan(msg: TaskMsg) -> Task:
    """The task a message carries (validated by its type: ValueError on inconsistent ids)."""
    kind = KINDS.get(msg.kind)
    if kind is None:
        raise ValueError(f"unknown task kind {msg.kind}")
    return task_of(msg.task_id, kind, msg.src, msg.dst, tuple(msg.keys))


def fence_for(peer: Peer, weights_version: str) -> TaskMsg:
    """The fence that lets transfer process ``peer`` start executing, under ``weights_version``."""
    return TaskMsg(FENCE_ID, FENCE, keys=(f"{peer.pid}:{peer.started}".encode(), weights_version.encode()))


def fence_names(msg: TaskMsg) -> tuple[int, int]:
    """(pid, start time) of the process a fence is addressed to."""
    if msg.kind != FENCE or len(msg.keys) != 2:
        raise ValueError(f"not a fence: task {msg.task_id} kind {msg.kind} with {len(msg.keys)} keys")
    pid, _, started = msg.keys[0].decode("ascii", "replace").partition(":")
    try:
        return int(pid), int(started)
    except ValueError:
        raise ValueError(f"malformed fence {msg.keys[0]!r}") from None


def fence_weights_version(msg: TaskMsg) -> str:
    """The weights version a fence hands its process (``fence_names`` validated it)."""
    return msg.keys[1].decode("utf-8")


def storage_namespace(spec: RunSpec, weights_version: str) -> bytes:
    """The 32-byte namespace fingerprint of the storage tier: values written under other
    model, weights or layout never verify (a weight update changes it)."""
    return namespace_fingerprint(spec.model_id, weights_version, spec.layout.describe())

"""Shared-memory IPC: rings, doorbells, typed channels, signal arrays, namespaces.

Owner (supervisor) side::

    ns = Namespace.create()                       # objects /fkv.<run_id>.*, 0600, manifest
    bell = Doorbell.create(ns, "engine.in")       # engine sleeps on this one semaphore
    done = [Channel.create(ns, f"done.{r}", bell=bell) for r in range(tp)]
    task = [Channel.create(ns, f"task.{r}") for r in range(tp)]
    ...
    ns.close()                                    # unlink everything; cleanup(run_id) after a crash

Other processes: ``ns = Namespace.attach(run_id)``; ``Channel.attach(ns, "task.0").bind("recv",
"transfer", 0)``. See ``channel`` for the timeout rule and ``ring``/``doorbell``/``codec`` for
the byte layouts and the wake-up protocol.
"""
from fastkv.ipc.channel import Broadcast, Channel, Gather, Inbox, TaskResult
from fastkv.ipc.codec import decode, encode, message
from fastkv.ipc.doorbell import Doorbell
from fastkv.ipc.errors import BadMessage, ChannelClosed, IPCError, MessageTooLarge, PeerDied, PeerError, PeerTimeout
from fastkv.ipc.messages import DoneMsg, OutputMsg, PlanMsg, TaskMsg
from fastkv.ipc.namespace import Namespace, RunInfo, cleanup, cleanup_stale, list_runs, stale_runs
from fastkv.ipc.peers import Peer, pid_alive
from fastkv.ipc.ring import Ring, Side
from fastkv.ipc.signals import SignalArray

__all__ = [
    "BadMessage", "Broadcast", "Channel", "ChannelClosed", "DoneMsg", "Doorbell", "Gather", "IPCError", "Inbox",
    "MessageTooLarge", "Namespace", "OutputMsg", "Peer", "PeerDied", "PeerError", "PeerTimeout", "PlanMsg", "Ring",
    "RunInfo", "Side", "SignalArray", "TaskMsg", "TaskResult", "cleanup", "cleanup_stale", "decode", "encode",
    "list_runs", "message", "pid_alive", "stale_runs",
]

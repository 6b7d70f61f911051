"""Typed channels over rings: one-way ``Channel``, a multi-channel ``Inbox`` on one
doorbell, ``Broadcast`` of one message to N ranks and ``Gather`` of their acks.

Timeout rule (everywhere): ``timeout=None`` waits forever, ``0`` never blocks, else
seconds. A receive that times out returns None / [] ("not now"); a send that cannot
complete raises ``PeerTimeout`` naming the consumer; any blocked wait raises
``PeerDied`` naming the peer (role, rank, pid) within one doorbell slice (50 ms) of
its death, after first delivering what the peer had sent.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any, NamedTuple

from fastkv.ipc.codec import bad_message, decode_many, encode, encode_many, type_of
from fastkv.ipc.doorbell import Doorbell
from fastkv.ipc.errors import BadMessage, PeerDied, PeerTimeout
from fastkv.ipc.messages import DoneMsg
from fastkv.ipc.namespace import Namespace
from fastkv.ipc.native import A
from fastkv.ipc.ring import Ring, Side


class Channel:
    """A one-way typed channel: ``send``/``send_many`` on the producer side,
    ``recv``/``recv_many`` on the consumer side. ``accept`` limits the message types
    (TypeError on send, BadMessage on receive of any other)."""

    def __init__(self, ring: Ring, accept: Sequence[type] | None = None) -> None:
        self.ring = ring
        self.accept = tuple(accept) if accept else None
        self._pending: deque[bytes] = deque()  # received but not yet decoded (after a bad message)

    @classmethod
    def create(cls, ns: Namespace, name: str, *, slot_size: int = 256, nslots: int = 1024,
               bell: Doorbell | None = None, accept: Sequence[type] | None = None) -> Channel:
        return cls(Ring.create(ns, name, slot_size=slot_size, nslots=nslots, data_bell=bell), accept)

    @classmethod
    def attach(cls, ns: Namespace, name: str, *, bell: Doorbell | None = None,
               accept: Sequence[type] | None = None) -> Channel:
        return cls(Ring.attach(ns, name, data_bell=bell), accept)

    def bind(self, side: Side | str, role: str, rank: int = 0) -> Channel:
        """Register this process as the sender (``"send"``) or receiver (``"recv"``)."""
        if isinstance(side, str):
            side = {"send": Side.PRODUCER, "recv": Side.CONSUMER}[side]
        self.ring.bind(side, role, rank)
        return self

    @property
    def name(self) -> str:
        return self.ring.local

    def close(self) -> None:
        self.ring.close()

    def __enter__(self) -> Channel:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- send --------------------------------------------------------------------------
    def encode(self, msg: Any) -> bytes:
        if self.accept is not None and type(msg) not in self.accept:
            raise TypeError(f"channel {self.name!r} carries {[c.__name__ for c in self.accept]}, "
                            f"not {type(msg).__name__}")
        return encode(msg)

    def send(self, msg: Any, timeout: float | None = None) -> None:
        self.ring.push_many((self.encode(msg),), timeout)

    def send_many(self, msgs: Iterable[Any], timeout: float | None = None) -> None:
        """Send in order; one head publish (and at most one wake-up) per ring-full."""
        self.ring.push_many(encode_many(msgs, self.accept, self.encode), timeout)

    def send_encoded(self, bufs: Sequence[bytes], timeout: float | None = None) -> None:
        """Send already-encoded messages (``Broadcast`` encodes once for N ranks)."""
        self.ring.push_many(bufs, timeout)

    # -- receive -----------------------------------------------------------------------
    def recv(self, timeout: float | None = None) -> Any | None:
        msgs = self.recv_many(1, timeout)
        return msgs[0] if msgs else None

    def recv_many(self, max_n: int = 256, timeout: float | None = None) -> list[Any]:
        """Up to ``max_n`` messages in order; waits only while none is available."""
        raws = self._take_pending(max_n) if self._pending else self.ring.pop_many(max_n, timeout)
        return self.decode_many(raws)

    def try_recv_many(self, max_n: int = 256) -> list[Any]:
        raws = self._take_pending(max_n) if self._pending else self.ring.try_pop_many(max_n)
        return self.decode_many(raws)

    def _take_pending(self, max_n: int) -> list[bytes]:
        return [self._pending.popleft() for _ in range(min(max_n, len(self._pending)))]

    def decode_many(self, raws: list[bytes]) -> list[Any]:
        """Decode in order. A bad message is raised on its own: messages before it are
        returned first, messages after it are kept for the next call; none is lost."""
        msgs, bad, why = decode_many(raws, self.accept)
        if bad < 0:
            return msgs
        rest = raws[bad:] if msgs else raws[bad + 1:]
        self._pending.extendleft(reversed(rest))
        if msgs:
            return msgs
        if why is not None:
            raise bad_message(raws[bad], why)
        raise BadMessage(f"channel {self.name!r} received a {type_of(raws[bad]).__name__}, "
                         f"expected {[c.__name__ for c in self.accept]}")

    def has_pending(self) -> bool:
        return bool(self._pending)


class Inbox:
    """One consumer, several channels, one doorbell: ``recv_many`` blocks on a single
    semaphore until any channel has a message. Every channel must have been created
    with ``bell=`` this doorbell."""

    def __init__(self, channels: Sequence[Channel], bell: Doorbell) -> None:
        for ch in channels:
            self._check_bell(ch, bell)
        self.channels = list(channels)
        self.bell = bell
        self._next = 0

    @staticmethod
    def _check_bell(ch: Channel, bell: Doorbell) -> None:
        if ch.ring.data_bell.local != bell.local:
            raise ValueError(f"channel {ch.name!r} rings {ch.ring.data_bell.local!r}, not this inbox's "
                             f"doorbell {bell.local!r}: create it with bell=")

    def remove(self, channel: Channel) -> None:
        """Stop listening to a channel (e.g. after its producer died)."""
        self.channels.remove(channel)

    def add(self, channel: Channel) -> None:
        """Listen to a channel again (its producer was restarted and re-bound it)."""
        self._check_bell(channel, self.bell)
        if channel in self.channels:
            raise ValueError(f"inbox already listens to channel {channel.name!r}")
        self.channels.append(channel)

    def _ready(self) -> bool:
        return any(ch.has_pending() for ch in self.channels) or A.any_used([ch.ring.hdr for ch in self.channels])

    def _check(self) -> None:
        for ch in self.channels:
            ch.ring.check_peer(Side.PRODUCER)

    def recv_many(self, max_n: int = 256, timeout: float | None = None) -> list[Any]:
        """Up to ``max_n`` messages from any channels, round-robin (no channel starves
        the others); [] on timeout; ``PeerDied`` (naming the producer) only when
        nothing is left to deliver. Per-channel order is preserved. A channel whose
        producer closed it delivers what it holds, then nothing: the wait goes on,
        asleep, on the other channels (a restarted producer re-binds and reopens it)."""
        if not self.channels:
            raise ValueError("inbox has no channels")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            out: list[Any] = []
            n = len(self.channels)
            for j in range(n):
                ch = self.channels[(self._next + j) % n]
                if len(out) >= max_n:
                    break
                out += ch.try_recv_many(max_n - len(out))
            self._next = (self._next + 1) % n
            if out:
                return out
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.bell.wait(self._ready, remaining, self._check, [ch.ring.hdr for ch in self.channels]):
                return []


class Broadcast:
    """The same message to N ranks (one channel each), encoded once."""

    def __init__(self, channels: Sequence[Channel]) -> None:
        self.channels = list(channels)

    def send(self, msg: Any, timeout: float | None = None) -> None:
        buf = self.channels[0].encode(msg)
        for ch in self.channels:
            ch.send_encoded((buf,), timeout)


class TaskResult(NamedTuple):
    task_id: int
    ok: bool
    error: str  # "rank r: text; ..." for every failed or dead rank, "" when ok
    nbytes: int  # summed over ranks
    seconds: float  # the slowest rank


class Gather:
    """Collects one DoneMsg per rank per task. A task completes when every rank has
    acked or died (its blocks stay in flight until then, so a failure cannot complete
    it early); it is ok only if every rank reported ok."""

    def __init__(self, n_ranks: int) -> None:
        if not isinstance(n_ranks, int) or n_ranks < 1:
            raise ValueError(f"n_ranks must be a positive int, got {n_ranks!r}")
        self.n_ranks = n_ranks
        self._acks: dict[int, dict[int, tuple[bool, str, int, float]]] = {}
        self._dead: dict[int, str] = {}

    def expect(self, task_id: int) -> TaskResult | None:
        """Start waiting for ``task_id``'s acks. Returns its (failed) result at once when
        every rank is dead, else None."""
        if task_id in self._acks:
            raise ValueError(f"task {task_id} is already pending")
        self._acks[task_id] = {}
        return self._complete(task_id) if self._dead else None

    @property
    def pending(self) -> list[int]:
        return list(self._acks)

    def missing(self, task_id: int) -> list[int]:
        """Ranks that have not yet acked ``task_id``."""
        return [r for r in range(self.n_ranks) if r not in self._acks[task_id]]

    def add(self, done: DoneMsg) -> TaskResult | None:
        """Record one ack; returns the task's result once it is complete."""
        acks = self._acks.get(done.task_id)
        if acks is None:
            raise ValueError(f"ack for unknown or finished task {done.task_id} from rank {done.rank}")
        if not 0 <= done.rank < self.n_ranks or done.rank in acks:
            raise ValueError(f"task {done.task_id}: bad or duplicate ack from rank {done.rank}")
        acks[done.rank] = (bool(done.ok), done.error, done.nbytes, done.seconds)
        return self._complete(done.task_id)

    def fail_rank(self, rank: int, reason: str) -> list[TaskResult]:
        """A rank died: it acks every pending and future task as failed with ``reason``."""
        self._dead[rank] = reason
        return [r for t in list(self._acks) if (r := self._complete(t)) is not None]

    def revive(self, rank: int) -> None:
        """A dead rank was replaced: tasks expected from now on wait for its ack again
        (tasks pending at its death keep the failure it was given)."""
        if rank not in self._dead:
            raise ValueError(f"rank {rank} is not dead")
        del self._dead[rank]

    @property
    def dead(self) -> dict[int, str]:
        """Dead ranks and why."""
        return dict(self._dead)

    def _complete(self, task_id: int) -> TaskResult | None:
        acks = self._acks[task_id]
        for rank, reason in self._dead.items():
            acks.setdefault(rank, (False, reason, 0, 0.0))
        if len(acks) < self.n_ranks:
            return None
        del self._acks[task_id]
        errors = [f"rank {r}: {a[1] or 'failed'}" for r, a in sorted(acks.items()) if not a[0]]
        return TaskResult(task_id, not errors, "; ".join(errors),
                          sum(a[2] for a in acks.values()), max(a[3] for a in acks.values()))

    def collect(self, inbox: Inbox | Channel, timeout: float | None = None) -> list[TaskResult]:
        """Receive until every expected task completes. A dead producer fails its rank
        (``PeerDied.rank``) and collection goes on with the other channels (a single
        Channel returns what completed). On timeout raises ``PeerTimeout``
        naming the ranks still owing acks. Non-DoneMsg messages raise TypeError."""
        results: list[TaskResult] = []
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._acks:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                msgs = inbox.recv_many(256, remaining)
            except PeerDied as exc:
                if isinstance(inbox, Inbox):
                    inbox.remove(next(c for c in inbox.channels if c.ring.peer(Side.PRODUCER).pid == exc.pid))
                results += self.fail_rank(exc.rank, f"{exc.role} pid {exc.pid} died")
                if not isinstance(inbox, Inbox) or not inbox.channels:
                    break  # nothing left to listen to: the rest stays pending
                continue
            if not msgs:
                late = sorted({r for t in self._acks for r in self.missing(t)})
                raise PeerTimeout(f"tasks {sorted(self._acks)} not acked within {timeout} s by ranks {late}",
                                  "transfer", late[0] if late else -1, 0)
            for m in msgs:
                if not isinstance(m, DoneMsg):
                    raise TypeError(f"Gather.collect received a {type(m).__name__}, expected DoneMsg")
                if (r := self.add(m)) is not None:
                    results.append(r)
        return results

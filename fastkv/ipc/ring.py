"""SPSC ring of fixed-size slots in POSIX shared memory, with doorbells.

The hot path (copy in/out, head/tail with acquire/release, fences, flag CAS) is in C
(``fastkv.native._atomics``, ops/shm_atomics.c) and holds the GIL for ~100 ns; only a wait on
an empty or full ring touches a semaphore (see ``fastkv.ipc.doorbell``).
"""
from __future__ import annotations

import time
from collections.abc import Sequence
from enum import IntEnum

from fastkv.ipc.doorbell import Doorbell
from fastkv.ipc.errors import BadMessage, ChannelClosed, MessageTooLarge, PeerDied, PeerError, PeerTimeout
from fastkv.ipc.namespace import Namespace
from fastkv.ipc.native import A
from fastkv.ipc.peers import Peer, me

HEADER = 512
OFF_SLOT_SIZE, OFF_NSLOTS, OFF_CLOSED, OFF_DROPPED = 8, 16, 24, 32
OFF_HEAD, OFF_TAIL = 64, 128
OFF_PEER = {0: 192, 1: 256}  # producer, consumer: pid, started, rank (int64), role (16 bytes)
OFF_DATA_BELL, OFF_SPACE_BELL, BELL_NAME_LEN = 320, 384, 64
SLOT_HDR = 8
assert (HEADER, OFF_HEAD, OFF_TAIL, SLOT_HDR, OFF_CLOSED, OFF_DROPPED) == (
    A.HEADER_SIZE, A.OFF_HEAD, A.OFF_TAIL, A.SLOT_HDR, A.OFF_CLOSED, A.OFF_DROPPED,
), "ring layout constants disagree with ops/shm_atomics.c: rebuild the extension"


class Side(IntEnum):
    PRODUCER = 0
    CONSUMER = 1


CLOSED_BY = {Side.PRODUCER: 1, Side.CONSUMER: 2}


class Ring:
    """One producer, one consumer, ``nslots`` slots of ``slot_size`` bytes.

    Byte layout of the shm segment (little-endian; every shared word an 8-byte aligned
    int64, cache-line separated where two processes write):

        off  size  field           written by
        0    8     magic           creator: b"FKVRING1"
        8    8     slot_size       creator (bytes per slot incl. its 8-byte header; multiple of 8, >= 16)
        16   8     nslots          creator
        24   8     closed          bit 0: producer closed, bit 1: consumer closed (atomic OR via CAS)
        32   8     dropped         consumer only: corrupt frames dropped (statistics, tests)
        64   8     head            producer only: slots ever published (release store)
        128  8     tail            consumer only: slots ever consumed (release store)
        192  32    producer peer   producer at bind: pid, start time, rank (int64), role (16 bytes, NUL padded)
        256  32    consumer peer   consumer at bind: same
        320  64    data bell       creator: local name of the consumer's doorbell (NUL padded)
        384  64    space bell      creator: local name of the producer's doorbell
        512  ...   slots           slot i at 512 + (i % nslots) * slot_size

    Slot: ``u32 len | u32 seq | payload[slot_size - 8]``. ``seq`` is the low 32 bits of
    the slot's absolute index (a check against reading a stale or torn frame).

    Messages larger than one slot SPAN consecutive slots: the first slot has
    ``len`` = message length and the first ``slot_size - 8`` bytes; each continuation
    slot has ``len`` = 0xFFFFFFFF and the next bytes. A message of L bytes takes
    max(1, ceil(L / (slot_size - 8))) slots and may wrap around the end. A message that
    needs more than ``nslots`` slots can never fit: ``MessageTooLarge`` (the ring is
    untouched).

    A corrupt frame (a first slot with a continuation mark, a wrong ``seq``, a length past
    head, a broken continuation) is dropped alone: the consumer skips to the next slot
    that is a sound first slot (not 0xFFFFFFFF, its own ``seq``), counts it in
    ``dropped`` and raises ``BadMessage``; the frames after it are delivered. Its length
    is not trusted, so a corrupt length cannot swallow the frames behind it.

    Order. Producer: write every slot of the message(s) with plain stores, then one
    release store of head, then a full fence and CAS(data bell waiting, 1 -> 0): post
    its semaphore if it was armed. Consumer: acquire load of head, copy slots out,
    release store of tail, full fence, CAS(space bell waiting, 1 -> 0): post if armed.
    A reader finding the ring empty (or a writer finding it full) waits on its doorbell.

    The data bell may be shared by several rings with the same consumer (``Inbox``).
    """

    def __init__(self, ns: Namespace, local: str, mm, data_bell: Doorbell, space_bell: Doorbell,
                 own_bells: tuple[Doorbell, ...]) -> None:
        self.ns, self.local, self._mm = ns, local, mm
        self._pin = memoryview(mm)
        self.hdr = A.address(self._pin)
        if A.load(self.hdr) != A.RING_MAGIC:
            raise ValueError(f"{ns.name(local)} is not a fastkv ring (bad magic)")
        self.slot_size = A.load(self.hdr + OFF_SLOT_SIZE)
        self.nslots = A.load(self.hdr + OFF_NSLOTS)
        self.payload = self.slot_size - SLOT_HDR
        self.data_bell, self.space_bell = data_bell, space_bell
        self._own_bells = own_bells
        self.side: Side | None = None

    # -- lifetime ----------------------------------------------------------------------
    @classmethod
    def create(cls, ns: Namespace, local: str, *, slot_size: int = 256, nslots: int = 1024,
               data_bell: Doorbell | None = None) -> Ring:
        """Create the ring and its private space bell (and a private data bell unless
        ``data_bell`` is given, for a consumer that waits on several rings)."""
        if not isinstance(slot_size, int) or slot_size < 16 or slot_size % 8:
            raise ValueError(f"slot_size must be an int >= 16 and a multiple of 8, got {slot_size!r}")
        if not isinstance(nslots, int) or not 1 <= nslots <= 1 << 24:
            raise ValueError(f"nslots must be an int in [1, 2**24], got {nslots!r}")
        mm = ns.create_shm(local, HEADER + slot_size * nslots)
        own = []
        if data_bell is None:
            data_bell = Doorbell.create(ns, f"{local}.data")
            own.append(data_bell)
        space_bell = Doorbell.create(ns, f"{local}.space")
        own.append(space_bell)
        mm[OFF_SLOT_SIZE:OFF_SLOT_SIZE + 8] = slot_size.to_bytes(8, "little")
        mm[OFF_NSLOTS:OFF_NSLOTS + 8] = nslots.to_bytes(8, "little")
        mm[OFF_DATA_BELL:OFF_DATA_BELL + BELL_NAME_LEN] = data_bell.local.encode().ljust(BELL_NAME_LEN, b"\0")
        mm[OFF_SPACE_BELL:OFF_SPACE_BELL + BELL_NAME_LEN] = space_bell.local.encode().ljust(BELL_NAME_LEN, b"\0")
        mm[0:8] = A.RING_MAGIC.to_bytes(8, "little")  # last: a ring with a magic is complete
        return cls(ns, local, mm, data_bell, space_bell, tuple(own))

    @classmethod
    def attach(cls, ns: Namespace, local: str, data_bell: Doorbell | None = None) -> Ring:
        """Open an existing ring; its doorbells are opened by the names in its header
        (pass ``data_bell`` when this process already holds the shared one)."""
        mm = ns.open_shm(local)
        names = [bytes(mm[o:o + BELL_NAME_LEN]).rstrip(b"\0").decode() for o in (OFF_DATA_BELL, OFF_SPACE_BELL)]
        own = []
        if data_bell is None or data_bell.local != names[0]:
            data_bell = Doorbell.attach(ns, names[0])
            own.append(data_bell)
        space_bell = Doorbell.attach(ns, names[1])
        own.append(space_bell)
        return cls(ns, local, mm, data_bell, space_bell, tuple(own))

    def bind(self, side: Side, role: str, rank: int = 0) -> Ring:
        """Register this process as the ring's producer or consumer (for peer-death
        detection and error messages).

        Re-binding a side after its previous owner died is how a restarted process takes
        over its ends: the new owner replaces the recorded peer and clears that side's
        closed bit (a predecessor that exited cleanly closed it). Messages the predecessor
        left in the ring stay there; the protocol above the ring decides what they mean
        (``fastkv.transfer`` fences them). Binding a side that another live process holds
        raises ``PeerError`` naming it: two owners of one side would corrupt the ring."""
        side = Side(side)
        self._check_open()
        role_b = role.encode()
        if len(role_b) > 16:
            raise ValueError(f"role name must be at most 16 bytes, got {role!r}")
        p, off = me(role, rank), OFF_PEER[side]
        held = self.peer(side)
        if held.pid and held.pid != p.pid and held.alive():
            raise PeerError(f"ring {self.local!r}: {side.name.lower()} side is held by {held.describe()}, "
                            f"which is alive", *held[:3])
        self._mm[off + 24:off + 40] = role_b.ljust(16, b"\0")
        A.store(self.hdr + off + 16, rank)
        A.store(self.hdr + off + 8, p.started)
        A.store(self.hdr + off, p.pid)
        self._clear_closed(CLOSED_BY[side])
        self.side = side
        return self

    def peer(self, side: Side) -> Peer:
        off = OFF_PEER[Side(side)]
        role = bytes(self._mm[off + 24:off + 40]).rstrip(b"\0").decode(errors="replace")
        return Peer(role, A.load(self.hdr + off + 16), A.load(self.hdr + off), A.load(self.hdr + off + 8))

    def peer_id(self, side: Side) -> tuple[int, int]:
        """(pid, start time) of ``peer(side)``: what tells a restarted process apart, read at
        a tenth of ``peer``'s cost (the engine checks it on every task it submits)."""
        at = self.hdr + OFF_PEER[side]
        return A.load(at), A.load(at + 8)

    def close(self) -> None:
        """Mark our bound side closed (the peer gets ChannelClosed, a blocked peer wakes)
        and unmap. The namespace owner unlinks the objects."""
        if self._pin is None:
            return
        if self.side is not None:
            self._set_closed(CLOSED_BY[self.side])
            (self.data_bell if self.side is Side.PRODUCER else self.space_bell).ring()
        self._pin.release()
        self._pin = None
        self._mm.close()
        for bell in self._own_bells:
            bell.close()

    def _set_closed(self, bit: int) -> None:
        addr = self.hdr + OFF_CLOSED
        while True:
            old = A.load(addr)
            if A.cas(addr, old, old | bit):
                return

    def _clear_closed(self, bit: int) -> None:
        addr = self.hdr + OFF_CLOSED
        while True:
            old = A.load(addr)
            if not old & bit or A.cas(addr, old, old & ~bit):
                return

    def _check_open(self) -> None:
        if self._pin is None:
            raise ChannelClosed(f"ring {self.local!r} is closed in this process")

    # -- state -------------------------------------------------------------------------
    def used(self) -> int:
        self._check_open()
        return A.used(self.hdr)

    def slots_for(self, nbytes: int) -> int:
        return max(1, -(-nbytes // self.payload))

    @property
    def dropped(self) -> int:
        """Corrupt frames the consumer has dropped over the ring's life."""
        self._check_open()
        return A.load(self.hdr + OFF_DROPPED)

    @property
    def capacity_bytes(self) -> int:
        return self.nslots * self.payload

    def check_integrity(self) -> None:
        """Header sane, 0 <= head - tail <= nslots, and (when no one is writing) every
        published frame well formed."""
        self._check_open()
        head, tail = A.load(self.hdr + OFF_HEAD), A.load(self.hdr + OFF_TAIL)
        assert A.load(self.hdr) == A.RING_MAGIC, f"ring {self.local}: magic overwritten"
        assert 0 <= head - tail <= self.nslots, f"ring {self.local}: head {head} tail {tail} nslots {self.nslots}"
        t = tail
        while t < head:
            off = HEADER + (t % self.nslots) * self.slot_size
            length = int.from_bytes(self._mm[off:off + 4], "little")
            seq = int.from_bytes(self._mm[off + 4:off + 8], "little")
            assert length != 0xFFFFFFFF and seq == t & 0xFFFFFFFF, f"ring {self.local}: bad frame at {t}"
            k = self.slots_for(length)
            assert t + k <= head, f"ring {self.local}: frame at {t} runs past head {head}"
            t += k

    # -- producer ----------------------------------------------------------------------
    def try_push_many(self, bufs: Sequence) -> int:
        """Push as many of ``bufs`` (in order) as fit now; returns how many."""
        self._check_open()
        if A.load(self.hdr + OFF_CLOSED) & CLOSED_BY[Side.CONSUMER]:
            raise self._closed_by(Side.CONSUMER)
        try:
            n, post = A.push_many(self.hdr, bufs, self.data_bell.flag_addr)
        except ValueError as exc:
            raise MessageTooLarge(f"ring {self.local!r}: {exc}") from None
        except TypeError as exc:
            raise TypeError(f"ring {self.local!r} takes bytes-like buffers: {exc}") from None
        if post:
            self.data_bell.post()
        return n

    def push_many(self, bufs: Sequence, timeout: float | None = None) -> None:
        """Push every buffer in order, blocking while the ring is full. Raises
        ``PeerTimeout`` naming the consumer if it has not made room within ``timeout``,
        ``PeerDied`` if the consumer died, ``ChannelClosed`` if it closed the ring."""
        done = self.try_push_many(bufs)
        if done == len(bufs):
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        while done < len(bufs):
            need = self.slots_for(len(bufs[done]))
            if need > self.nslots:
                self.try_push_many(bufs[done:done + 1])  # raises MessageTooLarge
                raise AssertionError("push_many: C accepted a message larger than the ring")
            ready = lambda need=need: self.nslots - A.used(self.hdr) >= need or A.load(self.hdr + OFF_CLOSED) & 2
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.space_bell.wait(ready, remaining, lambda: self.check_peer(Side.CONSUMER)):
                raise PeerTimeout(f"ring {self.local!r} full for {timeout} s: consumer "
                                  f"{self.peer(Side.CONSUMER).describe()} is not draining it",
                                  *self.peer(Side.CONSUMER)[:3])
            done += self.try_push_many(bufs[done:])

    def push(self, buf, timeout: float | None = None) -> None:
        self.push_many((buf,), timeout)

    # -- consumer ----------------------------------------------------------------------
    def try_pop_many(self, max_n: int) -> list[bytes]:
        self._check_open()
        try:
            bufs, post = A.pop_many(self.hdr, max_n, self.space_bell.flag_addr)
        except ValueError as exc:
            self.space_bell.ring()  # the corrupt frame was dropped: its space is free
            raise BadMessage(f"ring {self.local!r}: {exc}") from None
        if post:
            self.space_bell.post()
        return bufs

    def pop_many(self, max_n: int = 64, timeout: float | None = None) -> list[bytes]:
        """Up to ``max_n`` messages; blocks while empty. Returns [] on timeout (not an
        error), raises ``PeerDied`` if the producer died and left the ring empty, and
        ``ChannelClosed`` once the producer closed it and it is drained."""
        if not isinstance(max_n, int) or max_n < 1:
            raise ValueError(f"max_n must be a positive int, got {max_n!r}")
        bufs = self.try_pop_many(max_n)
        if bufs:
            return bufs
        deadline = None if timeout is None else time.monotonic() + timeout
        hdr = self.hdr
        ready = lambda: A.used(hdr) > 0 or A.load(hdr + OFF_CLOSED) & 1
        while True:
            if A.load(hdr + OFF_CLOSED) & 1 and A.used(hdr) == 0:
                raise self._closed_by(Side.PRODUCER)
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not self.data_bell.wait(ready, remaining, lambda: self.check_peer(Side.PRODUCER), (hdr,)):
                return []
            bufs = self.try_pop_many(max_n)
            if bufs:
                return bufs

    def _closed_by(self, side: Side) -> ChannelClosed:
        peer = self.peer(side)
        return ChannelClosed(f"ring {self.local!r}: the {side.name.lower()} closed it ({peer.describe()})", *peer[:3])

    def check_peer(self, side: Side) -> None:
        """PeerDied if ``side``'s process is gone without closing its end (one that closed
        first shut down cleanly: its channel is closed, not dead)."""
        peer = self.peer(side)
        if peer.pid and not peer.alive() and not A.load(self.hdr + OFF_CLOSED) & CLOSED_BY[side]:
            raise PeerDied(f"ring {self.local!r}: {side.name.lower()} {peer.describe()} died", *peer[:3])

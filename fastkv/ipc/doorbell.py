"""A doorbell: one semaphore on which one consumer sleeps for any number of rings.

Layout of the doorbell's shm segment (64 bytes, all fields little-endian int64):

    off  field     written by
    0    magic     creator: b"FKVBELL1"
    8    waiting   waiter: 1 just before it may sleep, 0 after it woke up;
                   ringer: 1 -> 0 (CAS) right before it posts the semaphore
    16   posts     ringer: +1 per post (statistics and tests)
    24   reserved

Protocol (no lost wake-up; spurious wake-ups are allowed and harmless):

    ringer (producer)                       waiter (the single consumer)
    1. publish (release store of head)       1. look at the rings: anything? -> return it
    2. full fence                            2. waiting = 1; full fence        (``arm``)
    3. if CAS(waiting, 1 -> 0): post         3. look again: anything? -> waiting = 0; return
                                             4. sem wait (timeout slice; GIL released)
                                             5. waiting = 0; back to 1

Steps 1-2 on each side form Dekker's pattern: with a full fence between each side's
store and its load of the other's word, at least one side sees the other's store. Either
the waiter's look in step 3 sees the message, or the ringer sees waiting == 1 and posts,
so the semaphore count is > 0 when the waiter blocks. The CAS means one post per sleep;
a post that races with a waiter which found data anyway leaves a count of 1: the next
wait returns at once, finds nothing, and sleeps again (a spurious wake-up).

The waiter sleeps in slices (``SLICE_S``): between slices it calls ``check()``, which
raises if a peer died, so a blocked wait notices a dead peer within one slice. That is
a blocked kernel wait with a periodic liveness check, not sleep-polling of the rings.

Spin before sleep. A waiter that names its rings (``spin_on``) first looks at them for up to a
budget in C, yielding its core between looks (``_atomics.spin_any``), without the GIL unless
its owner keeps it (``Spin.keep_gil``: the transfer loop, ``fastkv.transfer.lanes``). Waking a
process whose vCPU has halted costs far more than a message: on a VM without guest halt-polling
a round trip across vCPUs costs several times a small peer's work, so an empty transfer task's
time is mostly two such wake-ups. A spin answered keeps the vCPU awake and the wake-up cheap.
It costs a core while it lasts, so it is adaptive (``Spin``). The budget starts at ``SPIN_S``;
a wait whose answer came after the spin, but within ``SPIN_MAX_S`` of the wait's start (a copy
of a few hundred us), sets the next budget to cover it with a quarter to spare, so a run of
such waits stops paying the wake-up (a block-sized SWAP_OUT's round trip would pay it every
time); a longer wait sets it back. After ``SPIN_MISSES`` spins in a row that ended asleep (the
answer takes milliseconds: a model step) a waiter spins on one wait in ``PROBE_EVERY`` only;
its owner may turn it off (``Spin.enabled``).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import posix_ipc

from fastkv.ipc.namespace import Namespace
from fastkv.ipc.native import A
from fastkv.ipc.semwait import acquire

MAGIC = int.from_bytes(b"FKVBELL1", "little")
SIZE = 64
OFF_WAITING = 8
OFF_POSTS = 16
SLICE_S = 0.05
SPIN_S = 200e-6  # how long a waiter looks at its rings before it sleeps, at first ...
SPIN_MAX_S = 1e-3  # ... and at most, once answers came that late
SPIN_MISSES = 4  # this many spins in a row that ended asleep stop the spinning ...
PROBE_EVERY = 16  # ... but for one wait in this many


class Spin:
    """Whether the waiter spins before it sleeps, from how its recent spins ended."""

    __slots__ = ("misses", "waits", "enabled", "keep_gil", "budget")

    def __init__(self) -> None:
        self.misses = 0
        self.waits = 0
        self.enabled = True  # the owner turns it off where its core is better left to others
        self.keep_gil = False  # spin holding the GIL: no other thread of the process runs Python meanwhile
        self.budget = int(SPIN_S * 1e9)

    def budget_ns(self) -> int:
        self.waits += 1
        if not self.enabled or (self.misses >= SPIN_MISSES and self.waits % PROBE_EVERY):
            return 0
        return self.budget

    def ended(self, answered: bool, waited_ns: int | None = None) -> None:
        """How a spin ended: ``answered`` within it, or not, and then ``waited_ns`` the whole
        wait took until its answer (None: no answer, the wait timed out)."""
        if answered:
            self.misses = 0
            return
        self.misses += 1
        if waited_ns is not None and waited_ns <= SPIN_MAX_S * 1e9:
            self.budget = min(int(SPIN_MAX_S * 1e9), max(self.budget, waited_ns * 5 // 4))
        else:
            self.budget = int(SPIN_S * 1e9)


class Doorbell:
    def __init__(self, ns: Namespace, local: str, mm, sem: posix_ipc.Semaphore) -> None:
        self.ns, self.local, self._mm, self._sem = ns, local, mm, sem
        self._pin = memoryview(mm)  # keeps the mapping open while we hold raw addresses
        self.spin = Spin()  # one consumer waits on a doorbell: its waits' spin policy
        self._base = A.address(self._pin)
        self.flag_addr = self._base + OFF_WAITING
        if A.load(self._base) != MAGIC:
            raise ValueError(f"{ns.name(local)} is not a fastkv doorbell (bad magic)")

    @classmethod
    def create(cls, ns: Namespace, local: str) -> Doorbell:
        mm = ns.create_shm(local, SIZE)
        mm[0:8] = MAGIC.to_bytes(8, "little")
        return cls(ns, local, mm, ns.create_sem(local))

    @classmethod
    def attach(cls, ns: Namespace, local: str) -> Doorbell:
        return cls(ns, local, ns.open_shm(local), ns.open_sem(local))

    @property
    def posts(self) -> int:
        return A.load(self._base + OFF_POSTS)

    def post(self) -> None:
        """Post after the caller took the flag (a C push/pop returned must_post)."""
        A.add(self._base + OFF_POSTS, 1)
        self._sem.release()

    def ring(self) -> None:
        """Ringer steps 2-3, for callers that published by other means."""
        A.fence()
        if A.cas(self.flag_addr, 1, 0):
            self.post()

    def wait(self, ready: Callable[[], bool], timeout: float | None, check: Callable[[], None] | None = None,
             spin_on: Sequence[int] = ()) -> bool:
        """Block until ``ready()`` is true (True) or ``timeout`` seconds pass (False; None
        waits forever, 0 never blocks). ``check()`` runs between slices and when the
        wait times out; it raises to abort (peer death). ``spin_on``: the header addresses of
        the rings ``ready()`` looks at, watched for a while before sleeping (module docstring)."""
        if ready():
            return True
        spun_at = 0  # when a spin that found no answer started
        if spin_on and timeout != 0:
            budget = self.spin.budget_ns()
            if budget:
                spun_at = time.perf_counter_ns()
                if A.spin_any(spin_on, budget if timeout is None else min(budget, int(timeout * 1e9)),
                              self.spin.keep_gil):
                    self.spin.ended(True)
                    spun_at = 0
                    if ready():
                        return True
        answered = self._sleep(ready, timeout, check)
        if spun_at:  # the spin found no answer: how long the whole wait took sizes the next one
            self.spin.ended(False, time.perf_counter_ns() - spun_at if answered else None)
        return answered

    def _sleep(self, ready: Callable[[], bool], timeout: float | None, check: Callable[[], None] | None) -> bool:
        """``wait`` on the semaphore, in slices (after any spin)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        flag = self.flag_addr
        while True:
            A.arm(flag)
            if ready():
                A.store(flag, 0)
                return True
            if deadline is None:
                slice_s = SLICE_S
            else:
                slice_s = min(SLICE_S, deadline - time.monotonic())
                if slice_s <= 0:
                    A.store(flag, 0)
                    if check is not None and timeout:
                        check()
                    return False
            if not acquire(self._sem, slice_s):  # a timed-out slice, or a signal: look again
                A.store(flag, 0)
                if check is not None:
                    check()
                continue
            A.store(flag, 0)
            if ready():
                return True

    def close(self) -> None:
        if self._pin is None:
            return
        self._pin.release()
        self._pin = None
        self._mm.close()
        self._sem.close()

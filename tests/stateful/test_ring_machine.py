"""One ring against a deque: random-size pushes and pops (spanning slots, wrap-around,
full and empty), frame checks after every step."""
from __future__ import annotations

from collections import deque

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from fastkv.ipc import MessageTooLarge, Namespace, PeerTimeout, Ring

SLOT, NSLOTS = 32, 7  # 24 payload bytes per slot; 168 bytes capacity; 7 is not a power of two
PAYLOAD = SLOT - 8


def slots(n: int) -> int:
    return max(1, -(-n // PAYLOAD))


class RingMachine(RuleBasedStateMachine):
    @initialize()
    def setup(self):
        self.ns = Namespace.create()
        self.ring = Ring.create(self.ns, "ring", slot_size=SLOT, nslots=NSLOTS)
        self.model: deque[bytes] = deque()
        self.counter = 0

    def teardown(self):
        self.ring.close()
        self.ns.close()

    def used(self) -> int:
        return sum(slots(len(m)) for m in self.model)

    def make(self, size: int) -> bytes:
        self.counter += 1
        return (self.counter.to_bytes(4, "little") * (size // 4 + 1))[:size]

    @rule(sizes=st.lists(st.integers(0, 3 * PAYLOAD + 5), min_size=1, max_size=5))
    def push(self, sizes):
        msgs = [self.make(n) for n in sizes]
        fit = 0
        free = NSLOTS - self.used()
        for m in msgs:
            if slots(len(m)) > free:
                break
            free -= slots(len(m))
            fit += 1
        assert self.ring.try_push_many(msgs) == fit
        self.model.extend(msgs[:fit])

    @rule(size=st.integers(0, NSLOTS * PAYLOAD))
    def push_blocking_when_full(self, size):
        msg = self.make(size)
        if slots(size) <= NSLOTS - self.used():
            self.ring.push(msg, timeout=0)
            self.model.append(msg)
        else:
            try:
                self.ring.push(msg, timeout=0)
            except PeerTimeout as exc:
                assert "full" in str(exc)
            else:
                raise AssertionError("push into a full ring succeeded")

    @rule(extra=st.integers(1, 100))
    def push_too_large(self, extra):
        try:
            self.ring.push(self.make(NSLOTS * PAYLOAD + extra), timeout=0)
        except MessageTooLarge:
            pass
        else:
            raise AssertionError("a message larger than the ring was accepted")

    @rule(n=st.integers(1, 8))
    def pop(self, n):
        got = self.ring.pop_many(n, timeout=0)
        want = [self.model.popleft() for _ in range(min(n, len(self.model)))]
        assert got == want

    @precondition(lambda self: not self.model)
    @rule()
    def pop_empty(self):
        assert self.ring.pop_many(4, timeout=0) == []

    @invariant()
    def consistent(self):
        if hasattr(self, "ring"):
            self.ring.check_integrity()
            assert self.ring.used() == self.used()


TestRing = RingMachine.TestCase

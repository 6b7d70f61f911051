"""The block pool against a list-and-dict reference model, after every step."""
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fastkv.cache.pool import BlockPool, BlockState

N = 6
KEYS = [b"k%d" % i for i in range(8)]
FREE, ALLOCATED, CACHED, IN_FLIGHT = BlockState


class PoolMachine(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.pool = BlockPool("device", N)
        self.ref = [0] * N
        self.pins = [0] * N
        self.key = [None] * N
        self.free = list(range(N))[::-1]  # a stack
        self.lru = []

    # ---- reference transitions
    def state(self, b):
        if self.pins[b]:
            return IN_FLIGHT
        if self.ref[b]:
            return ALLOCATED
        return CACHED if self.key[b] is not None else FREE

    def settle(self, b):
        """After a refcount or pin drop: where the reference model puts the block."""
        st_ = self.state(b)
        if st_ is CACHED:
            self.lru.append(b)
        elif st_ is FREE:
            self.free.append(b)

    def blocks_in(self, *states):
        return [b for b in range(N) if self.state(b) in states]

    # ---- rules
    @rule(pinned=st.booleans())
    def take(self, pinned):
        if self.free:
            expect, evicted = self.free.pop(), None
        elif self.lru:
            expect = self.lru.pop(0)
            evicted = (expect, self.key[expect])
            self.key[expect] = None
        else:
            expect, evicted = None, None
        out = []
        got = self.pool.take_pinned(out) if pinned else self.pool.take(out)
        assert got == expect
        assert out == ([evicted] if evicted else [])
        if got is not None:
            if pinned:
                self.pins[got] = 1
            else:
                self.ref[got] = 1

    @rule(n=st.integers(1, 3))
    def compute_and_cache(self, n):
        """The common life of a block: taken, computed (keyed), released into the LRU queue."""
        if n > len(self.free) + len(self.lru):
            return
        self.take_many(n)
        for b in range(N):
            if self.ref[b] == 1 and self.key[b] is None and not self.pins[b]:
                k = next((k for k in KEYS if k not in self.key), None)
                if k is not None:
                    assert self.pool.set_key(b, k)
                    self.key[b] = k
        for b in [b for b in range(N) if self.ref[b] == 1 and not self.pins[b]][::-1]:
            self.pool.release(b)
            self.ref[b] = 0
            self.settle(b)

    @rule(n=st.integers(0, N))
    def take_many(self, n):
        if n > len(self.free) + len(self.lru):
            with pytest.raises(ValueError, match="available"):
                self.pool.take_many(n)
            return
        expect, evicted = [], []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b = self.lru.pop(0)
                evicted.append((b, self.key[b]))
                self.key[b] = None
            expect.append(b)
            self.ref[b] = 1
        out = []
        assert self.pool.take_many(n, out) == expect
        assert out == evicted

    @rule(data=st.data())
    def incref(self, data):
        cands = [b for b in range(N) if self.state(b) is not FREE]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        if self.state(b) is CACHED:
            self.lru.remove(b)
        self.pool.incref(b)
        self.ref[b] += 1

    @precondition(lambda self: any(self.ref))
    @rule(data=st.data(), keep=st.booleans() | st.just(True))
    def release(self, data, keep):
        b = data.draw(st.sampled_from([b for b in range(N) if self.ref[b]]))
        self.pool.release(b, keep)
        self.ref[b] -= 1
        if self.ref[b] == 0 and not keep:
            self.key[b] = None
        if self.ref[b] == 0 and not self.pins[b]:
            self.settle(b)

    @rule(b=st.integers(0, N - 1))
    def release_unheld(self, b):
        if self.ref[b] == 0:
            with pytest.raises(ValueError, match="double free"):
                self.pool.release(b)

    @precondition(lambda self: any(self.ref[b] and self.key[b] is None for b in range(N)))
    @rule(data=st.data())
    def compute_and_key(self, data):
        """The common life: a held block gets the first unused key."""
        b = data.draw(st.sampled_from([b for b in range(N) if self.ref[b] and self.key[b] is None]))
        k = next((k for k in KEYS if k not in self.key), None)
        if k is not None and not self.pins[b]:
            assert self.pool.set_key(b, k)
            self.key[b] = k

    @rule(data=st.data())
    def pin(self, data):
        b = data.draw(st.integers(0, N - 1))
        if self.state(b) is FREE:
            with pytest.raises(ValueError, match="FREE"):
                self.pool.pin(b)
            return
        if self.state(b) is CACHED:
            self.lru.remove(b)
        self.pool.pin(b)
        self.pins[b] += 1

    @precondition(lambda self: any(self.pins))
    @rule(data=st.data())
    def unpin(self, data):
        b = data.draw(st.sampled_from([b for b in range(N) if self.pins[b]]))
        self.pool.unpin(b)
        self.pins[b] -= 1
        if not self.pins[b] and not self.ref[b]:
            self.settle(b)

    @rule(data=st.data(), k=st.sampled_from(KEYS))
    def set_key(self, data, k):
        cands = [b for b in self.blocks_in(ALLOCATED, IN_FLIGHT) if self.key[b] is None]
        if not cands:
            return
        b = data.draw(st.sampled_from(cands))
        expect = k not in self.key
        assert self.pool.set_key(b, k) is expect
        if expect:
            self.key[b] = k

    @rule(b=st.integers(0, N - 1))
    def evict(self, b):
        if self.state(b) is not CACHED:
            with pytest.raises(ValueError):
                self.pool.evict(b)
            return
        assert self.pool.evict(b) == self.key[b]
        self.key[b] = None
        self.lru.remove(b)
        self.free.append(b)

    @rule(b=st.integers(0, N - 1))
    def touch(self, b):
        self.pool.touch(b)
        if self.state(b) is CACHED:
            self.lru.remove(b)
            self.lru.append(b)

    @rule(b=st.integers(0, N - 1))
    def drop_key(self, b):
        was = self.state(b)
        assert self.pool.drop_key(b) == self.key[b]
        self.key[b] = None
        if was is CACHED:
            self.lru.remove(b)
            self.free.append(b)

    @invariant()
    def matches_the_model(self):
        p = self.pool
        p.check_integrity()
        assert [BlockState(s) for s in p.state] == [self.state(b) for b in range(N)]
        assert p.ref == self.ref and p.pins == self.pins and p.key == self.key
        assert list(p.evictable) == self.lru and p.free == self.free
        assert p.num_free + p.num_cached + p.num_allocated + p.num_in_flight == N


PoolMachine.TestCase.settings = settings(settings.default, stateful_step_count=40)
test_pool_machine = PoolMachine.TestCase

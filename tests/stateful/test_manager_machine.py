"""The whole cache manager against a reference model of block *contents*.

The test plays the worker and the transfer processes: a compute step writes, into each block
it covers, a token standing for the KV it would hold (a full block's chained key, or the
tokens of a partial block); a copy moves those tokens when the test completes its plan, in
random order, sometimes failing (and then writes garbage into its destination, as a half-done
copy would). After every step:

* ``check_integrity()``;
* every keyed device or host block holds exactly the content of its key (a key never points
  at bad bytes), every stored key's storage value is its content;
* every ready request's blocks hold its tokens' content up to ``num_computed``;
* a compute step only writes blocks its request alone holds and no copy touches;
* no CACHED key whose parent is in no tier nor on its way to one, whatever was lost (a loss
  drops the children it strands: fastkv.cache.strands); and without failures, skipped copies or
  dropped keys, no keyed block at all behind a missing parent (one whose bytes only a running
  request's duplicate block holds counts as present: that block takes the key on the request's
  next insert or at its free).

``REACHED`` counts (and ``hypothesis.event`` reports) each copy's purpose by its outcome: done,
failed, or its request freed while it flew; and LOADs whose storage key was lost meanwhile.
Under the CI profile (derandomized, 500 examples) it must reach every case in ``CASES``: rules
steer into the rare ones (copies completed and failed by purpose, frees of requests whose copy
flies, prompts another engine stored, floods that evict every cached block).
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import event
from hypothesis import strategies as st
from hypothesis.stateful import (
    INVARIANT_MARKER,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from fastkv.cache.copies import Purpose
from fastkv.cache.keys import ExtraKeys
from fastkv.cache.manager import CacheConfig, CacheManager
from fastkv.cache.plan import CopyKind
from fastkv.cache.pool import BlockState
from fastkv.cache.request_policy import CachePolicy as RequestPolicy
from fastkv.cache.requests import ReqState
from fastkv.cache.write_policy import Tier
from fastkv.cache.write_policy import WritePolicy as Policy
from tests.stateful.coverage import run_and_check_coverage

BS = 2
# prompts are prefixes of a few conversations, so that they share prefixes often
CONVERSATIONS = ((0, 1, 2, 3), (0, 1, 4, 5), (6, 7, 2, 3), (0, 6, 8), (9, 10, 11), (0, 1, 2, 12))
LABELS = st.builds(lambda c, n: CONVERSATIONS[c][:n], st.integers(0, len(CONVERSATIONS) - 1), st.integers(0, 4))
OWNED = (Purpose.WRITE_BACK, Purpose.PREFIX_LOAD, Purpose.FILL, Purpose.OFFLOAD)  # a request waits for these
CASES = frozenset(
    {f"{p.name} {how}" for p in (*OWNED, Purpose.WRITE_THROUGH, Purpose.STORE) for how in ("done", "failed")}
    | {f"{p.name} freed during" for p in (*OWNED, Purpose.WRITE_THROUGH)} | {"storage lost a key of a LOAD in flight"}
    # a parent in flight when a request's chain hold reached it (tiering.hold_chain) lands
    | {"a chain hold joins a parent as it lands", "a chain hold let go before its parent landed",
       "a running request let go of its chain hold for host room"}
    # leaves first whatever order a chain reached a tier in (pool.py): a child landing in a later
    # plan than its parent's, and a host eviction that passes over a parent for its child
    | {"a child lands on the host in a later plan than its parent", "the host passes over a parent for its child"})
REACHED: Counter[str] = Counter()
# what a request brings besides its tokens, (cache_salt, lora, image hash), and its cache policy
TENANTS = [(None, None, None), ("acme", None, None), ("globex", None, None), (None, 1, None), (None, None, b"img-a"),
           (None, None, b"img-b")]
POLICIES = [None, False, {"read": ["device", "host"]}, {"read": ["device"]}, {"read": ["device"], "write": []}]


def tokens_of(labels, tail: int) -> list[int]:
    return [t for lab in labels for t in range(lab * 10, lab * 10 + BS)] + [90 + i for i in range(tail)]


def reached(case: str) -> None:
    assert case in CASES, f"unknown case {case!r}"
    REACHED[case] += 1
    event(case)


class ManagerMachine(RuleBasedStateMachine):
    # backlog: STOREs in flight past which optional ones are deferred (store_backlog.py), or lost
    @initialize(policy=st.sampled_from(Policy), dev=st.integers(4, 9), host=st.integers(0, 10),
                storage=st.booleans(), backlog=st.sampled_from((0, 1, 3, 256)))
    def setup(self, policy, dev, host, storage, backlog=256):
        self.m = CacheManager(CacheConfig(num_device_blocks=dev, num_host_blocks=host, block_size=BS,
                                          policy=policy, storage=storage, selective_hits=1,
                                          storage_backlog_blocks=backlog))
        self.dev_data = [None] * dev
        self.host_data = [None] * max(host, 1)
        self.storage: dict[bytes, object] = {}
        self.tokens: dict[int, list[int]] = {}
        self.private: dict[bytes, object] = {}  # private key -> expected content
        self.parent: dict[bytes, bytes] = {}
        self.outstanding = []
        self.purpose: dict[int, tuple[Purpose, object]] = {}  # plan id -> (purpose, its request or None)
        self.freed: set[object] = set()
        self.next_rid = 0
        # keys a loss took (a failure, a skipped copy, a dropped key, storage losing it): children
        # behind one of them, or behind a key dropped as their strand, may be stranded
        self.lost: set[bytes] = set()
        self.extra: dict[int, ExtraKeys | None] = {}  # a request's extras (tenant, adapter, image)
        self.policy: dict[int, RequestPolicy | None] = {}  # its cache policy
        self.written: set[bytes] = set()  # keys of requests that may write: the only ones a tier may hold
        self.skips = 0  # skipped host copies seen so far (stats.skipped_copies)
        self.was_present: set[bytes] = set()

    # ------------------------------------------------------------------ model helpers
    def content(self, rid, i, upto):
        toks = self.tokens[rid]
        keys = self.m.keys_for(toks[: (i + 1) * BS], self.extra.get(rid))
        if (i + 1) * BS <= upto:
            return keys[i]
        parent = keys[i - 1] if i else b"root"
        return ("partial", parent, tuple(toks[i * BS: upto]))

    def learn_parents(self, toks, rid=None):
        keys = self.m.keys_for(toks, self.extra.get(rid))
        policy = self.policy.get(rid)
        if policy is None or policy.write:
            self.written.update(keys)
        for i in range(1, len(keys)):
            self.parent[keys[i]] = keys[i - 1]

    def running(self, ready=True):
        return [r for r, req in self.m._reqs.items()
                if req.state is ReqState.RUNNING and (not ready or req.pending == 0)]

    def add(self, plans):
        for p in plans:
            self.purpose[p.plan_id] = self.copy_purpose(p)
        self.outstanding += list(plans)

    def copy_purpose(self, plan):
        """What a copy is for and whom it serves: the one read of the manager's copy book."""
        rec = self.m.copies.records[plan.plan_id]
        req = rec.req if rec.req is not None else rec.owner  # a write-through's: the request holding its chain
        return rec.purpose, req.rid if req is not None else None

    # ------------------------------------------------------------------ rules
    @rule(labels=LABELS, tail=st.integers(0, BS - 1), reserve=st.sampled_from([0, 0, 1, BS + 1]))
    def allocate(self, labels, tail, reserve):
        self._allocate(tokens_of(labels, tail), reserve)

    @precondition(lambda self: self.m.index.storage and self.m.host.capacity)
    @rule(labels=LABELS.filter(len), reserve=st.sampled_from([0, 1]))
    def allocate_stored_elsewhere(self, labels, reserve):
        """Another engine stored this prompt's blocks and a lookup found them (Engine's lookups
        call ``confirm_stored``): what the device and host lack is LOADed (PREFIX_LOAD)."""
        toks = tokens_of(labels, 1)
        keys = self.m.keys_for(toks)
        for k in keys:
            self.storage[k] = k
        self.m.confirm_stored(keys)
        self._allocate(toks, reserve)

    @precondition(lambda self: self.m.device.num_cached)
    @rule()
    def flood(self):
        """A prompt of fresh tokens as long as the device's cached blocks: it evicts them all
        (under WRITE_BACK each victim without a host copy is written back, WRITE_BACK)."""
        n = min(self.m.device.num_cached, self.m.device.num_available - self.m.state.reserved)
        self.floods = getattr(self, "floods", 0) + 1
        self._allocate([1000 * self.floods + i for i in range(n * BS)], 0)

    @rule(labels=LABELS, tail=st.integers(0, BS - 1), tenant=st.sampled_from(TENANTS),
          policy=st.sampled_from(POLICIES))
    def allocate_keyed(self, labels, tail, tenant, policy):
        """A prompt of a tenant or an adapter, or with an image over its second block, under a
        cache policy: its hits hold its own chain's bytes, from the tiers it may read only."""
        extra = ExtraKeys.of(*tenant[:2], [(BS, 2 * BS, tenant[2])] if tenant[2] else ())
        self._allocate(tokens_of(labels, tail), 0, extra, RequestPolicy.of(policy))

    def _allocate(self, toks, reserve, extra=None, policy=None):
        if not toks:
            return
        rid = self.next_rid
        self.next_rid += 1
        self.tokens[rid], self.extra[rid], self.policy[rid] = toks, extra, policy
        self.learn_parents(toks, rid)
        a = self.m.allocate(rid, np.array(toks, np.int32), extra, reserve_tokens=reserve, policy=policy)
        if a is None:
            del self.tokens[rid]
            return
        if policy is not None:
            kinds = {p.kind for p in a.plans}
            assert CopyKind.LOAD not in kinds or Tier.STORAGE in policy.readable, f"request {rid} loads from storage"
            assert CopyKind.SWAP_IN not in kinds or Tier.HOST in policy.readable, f"request {rid} swaps in from host"
        for i in range(a.num_cached_tokens // BS):  # device hits hold the right bytes now
            assert self.dev_data[a.block_table[i]] == self.content(rid, i, len(toks))
        self.add(a.plans)

    @precondition(lambda self: self.running())
    @rule(data=st.data(), finish=st.booleans())
    def compute(self, data, finish):
        """A step; with ``finish`` the request computes everything and is freed (cached)."""
        rid = data.draw(st.sampled_from(self.running()))
        req = self.m._reqs[rid]
        if req.num_computed == req.num_tokens:
            if finish:
                self.m.free(rid)
                self._left_nothing(rid)
            return
        n = req.num_tokens if finish else data.draw(st.integers(req.num_computed + 1, req.num_tokens))
        self._compute(rid, n)
        if finish:
            self.m.free(rid)
            self._left_nothing(rid)

    def _compute(self, rid, n):
        req = self.m._reqs[rid]
        for i in range(req.num_computed // BS, -(-n // BS)):
            b = req.table[i]
            assert self.m.device.state[b] == BlockState.ALLOCATED, f"step writes block {b} that a copy touches"
            assert self.m.device.ref[b] == 1 and self.m.device.key[b] is None, f"step writes shared block {b}"
            self.dev_data[b] = self.content(rid, i, n)
        self.add(self.m.mark_computed(rid, n))

    @precondition(lambda self: self.m.policy is Policy.WRITE_THROUGH and self.m.host.capacity)
    @rule(labels=LABELS)
    def extend_a_block_in_flight(self, labels):
        """A prompt ending in a fresh block is computed, and its write-through flies; a second
        prompt, the first and one block more, is computed before it lands: the second request's
        chain hold (tiering.hold_chain) waits for the first's block to land."""
        toks = tokens_of(labels, 0) + [800 + BS * self.next_rid + j for j in range(BS)]
        for prompt in (toks, toks + [700 + j for j in range(BS)]):
            self._allocate(prompt, 0)
            rid = self.next_rid - 1
            if rid not in self.running():
                return
            self._compute(rid, len(prompt))

    def computed(self) -> list[object]:
        """Running requests that computed every token they have: those a decode step grows."""
        return [r for r in self.running() if self.m._reqs[r].num_computed == self.m._reqs[r].num_tokens]

    @precondition(lambda self: self.computed())
    @rule(data=st.data(), n=st.integers(1, 3))
    def append(self, data, n):
        """Decode growth: a request that computed all its tokens takes slots for ``n`` more."""
        rid = data.draw(st.sampled_from(self.computed()))
        new = [50 + len(self.tokens[rid]) + i for i in range(n)]
        g = self.m.append_slots(rid, np.array(new, np.int32))
        if g is None:
            return
        self.tokens[rid] += new
        self.learn_parents(self.tokens[rid], rid)
        self.add(g.plans)

    @precondition(lambda self: self.m._reqs)
    @rule(data=st.data(), cache=st.booleans() | st.just(True))
    def free(self, data, cache):
        """A request finished or aborted: the scheduler's abort, in any state, is this call."""
        self._free(data.draw(st.sampled_from(sorted(self.m._reqs))), cache)

    @precondition(lambda self: self.serving())
    @rule(data=st.data(), cache=st.booleans() | st.just(True))
    def free_while_copying(self, data, cache):
        """Free (finish or abort) a request while a copy it waits for flies, the purpose picked first
        (rare ones count)."""
        serving = self.serving()
        purpose = data.draw(st.sampled_from(list(serving)))  # in the order of the copies, not by name
        self._free(data.draw(st.sampled_from(sorted(serving[purpose]))), cache)

    def serving(self) -> dict[str, set[object]]:
        """Live requests with a copy in flight, by the copy's purpose."""
        out: dict[str, set[object]] = {}
        for purpose, rid in self.purpose.values():
            if rid in self.m._reqs:
                out.setdefault(purpose.name, set()).add(rid)
        return out

    def _free(self, rid, cache):
        if not cache:
            self.lost.update(self.m._reqs[rid].keys)
        self.freed.add(rid)
        self.m.free(rid, cache)
        assert rid not in self.m.request_ids(), f"request {rid} freed, still holding blocks"
        self._left_nothing(rid)

    def _left_nothing(self, rid):
        """A request that may not write left no key of its own (one no writer computed) in a tier."""
        policy = self.policy.get(rid)
        if policy is None or policy.write:
            return
        m = self.m
        own = set(m.keys_for(self.tokens[rid], self.extra[rid])) - self.written
        left = own & (set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored))
        assert not left, f"request {rid} may not write, but {len(left)} of its keys are cached"

    @precondition(lambda self: self.m.host.capacity and self.running())
    @rule(data=st.data())
    def offload(self, data):
        rid = data.draw(st.sampled_from(self.running()))
        if self.policy.get(rid) is not None and not self.policy[rid].write:
            with pytest.raises(ValueError, match="lets it write nothing"):
                self.m.offload(rid)
            return
        plans = self.m.offload(rid)
        if plans is None:
            return
        req = self.m._reqs[rid]
        if req.resume.private_key is not None and req.num_computed % BS:
            last = -(-req.num_computed // BS) - 1
            self.private[req.resume.private_key] = self.content(rid, last, req.num_computed)
        self.add(plans)

    @precondition(lambda self: any(r.state is ReqState.OFFLOADED for r in self.m._reqs.values()))
    @rule(data=st.data(), reserve=st.integers(0, BS))
    def restore(self, data, reserve):
        rid = data.draw(st.sampled_from([r for r, q in self.m._reqs.items() if q.state is ReqState.OFFLOADED]))
        a = self.m.restore(rid, reserve)
        if a is not None:
            self.add(a.plans)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data(), ok=st.booleans() | st.just(True) | st.just(True))
    def complete(self, data, ok):
        self._complete(data, ok)

    @precondition(lambda self: self.outstanding)
    @rule(data=st.data())
    def fail(self, data):
        """A copy fails (so that each purpose's failure is reached, not only its success)."""
        self._complete(data, False)

    def _complete(self, data, ok):
        """A copy finishes, its purpose picked first (rare ones count), then one of its copies."""
        purpose = data.draw(st.sampled_from(sorted({self.purpose[p.plan_id][0] for p in self.outstanding})))
        mine = [i for i, p in enumerate(self.outstanding) if self.purpose[p.plan_id][0] is purpose]
        self._land(self.outstanding.pop(data.draw(st.sampled_from(mine))), ok)

    def _land(self, plan, ok, count=True):
        """``plan`` completes (``ok``) or fails: its bytes move in the model; ``count``: its
        outcome counts as a case reached (not in the teardown, where every copy just lands)."""
        m = self.m
        pools = {CopyKind.SWAP_OUT: (m.device, m.host), CopyKind.SWAP_IN: (m.host, m.device),
                 CopyKind.STORE: (m.host, None), CopyKind.LOAD: (None, m.host)}
        src_pool, dst_pool = pools.get(plan.kind, (None, None))
        for pool, ids in ((src_pool, plan.src), (dst_pool, plan.dst)):
            for b in ids.tolist():
                assert pool.state[b] == BlockState.IN_FLIGHT, f"plan {plan.plan_id} touches {pool.tier} block {b}"
        if plan.kind is CopyKind.LOAD:
            ok = ok and all(k in self.storage for k in plan.keys)
        if ok and count and plan.kind in (CopyKind.SWAP_OUT, CopyKind.LOAD):
            if any(self.parent.get(k) in m.host.lookup for k in m.copies.records[plan.plan_id].keys):
                reached("a child lands on the host in a later plan than its parent")
        if ok and count and plan.kind is CopyKind.SWAP_OUT:
            for k in m.copies.records[plan.plan_id].keys:
                for holder in m.copies.awaited.get(k, ()):
                    if type(holder) is tuple:
                        req, gen = holder
                        reached("a chain hold joins a parent as it lands" if req.chain.gen == gen
                                and req.chain.held else "a chain hold let go before its parent landed")
        purpose, rid = self.purpose.pop(plan.plan_id)
        if not ok:
            self.lost.update(m.copies.records[plan.plan_id].keys)
            self.lost.update(plan.keys)
        if count and purpose is not Purpose.CONTROL:
            reached(f"{purpose.name} {'freed during' if rid in self.freed else 'done' if ok else 'failed'}")
        data_of = {id(m.device): self.dev_data, id(m.host): self.host_data}
        if ok and plan.kind is CopyKind.STORE:
            for b, k in zip(plan.src.tolist(), plan.keys, strict=True):
                self.storage[k] = self.host_data[b]
        elif ok and plan.kind is CopyKind.LOAD:
            for b, k in zip(plan.dst.tolist(), plan.keys, strict=True):
                self.host_data[b] = self.storage[k]
        elif ok and src_pool is not None and dst_pool is not None:
            src, dst = data_of[id(src_pool)], data_of[id(dst_pool)]
            for s, d in zip(plan.src.tolist(), plan.dst.tolist(), strict=True):
                dst[d] = src[s]
        elif not ok and dst_pool is not None:
            for d in plan.dst.tolist():
                data_of[id(dst_pool)][d] = ("garbage", plan.plan_id)
        c = m.complete(plan, ok)
        self.add(c.plans)
        for r in c.ready:
            assert r.num_computed_tokens == m.num_computed_tokens(r.request_id)

    @precondition(lambda self: self.storage)
    @rule(data=st.data())
    def storage_loses_a_key(self, data):
        """Storage drops a key (eviction, a restart)."""
        key = data.draw(st.sampled_from(sorted(self.storage)))
        del self.storage[key]
        self.lost.add(key)

    @precondition(lambda self: self.loading_keys())
    @rule(data=st.data())
    def storage_loses_a_key_being_loaded(self, data):
        """Storage drops a key between the lookup and the LOAD that reads it."""
        reached("storage lost a key of a LOAD in flight")
        key = data.draw(st.sampled_from(self.loading_keys()))
        del self.storage[key]
        self.lost.add(key)

    def loading_keys(self) -> list[bytes]:
        return sorted({k for p in self.outstanding if p.kind is CopyKind.LOAD for k in p.keys} & self.storage.keys())

    @precondition(lambda self: not self.m._reqs and not self.outstanding)
    @rule(go=st.integers(0, 9))
    def weight_update(self, go):
        if go:  # rare: it wipes the state the other rules build up
            return
        self.updates = getattr(self, "updates", 0) + 1
        clear = self.m.begin_weight_update()
        self.m.complete(clear, True)
        restore = self.m.finish_weight_update(f"v{self.updates}")
        self.m.complete(restore, True)
        self.storage.clear()
        assert not self.m.device.lookup and not self.m.host.lookup and not self.m.index.stored

    @rule(labels=LABELS)
    def match(self, labels):
        toks = tokens_of(labels, 1)
        r = self.m.match(np.array(toks, np.int32))
        keys = self.m.keys_for(toks)
        for i, b in enumerate(r.device_blocks):
            assert self.m.device.key[b] == keys[i] and self.dev_data[b] == keys[i]
        e = self.m.explain_miss(np.array(toks, np.int32))
        assert e.block_index >= r.num_blocks

    # ------------------------------------------------------------------ invariants
    @invariant()
    def no_key_stranded_by_eviction(self):
        """No cached key whose parent is in no tier (nor on its way to one), copies in flight or
        not, whatever was lost (a failure, a skipped copy, a dropped key, storage losing one, a
        parent a tier had to evict with children left): a loss drops the children it strands."""
        m = self.m
        if self.m.host.passed_over > getattr(self, "passed_over", 0):
            self.passed_over = m.host.passed_over
            reached("the host passes over a parent for its child")
        present = set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored) | set(m.copies.inflight) \
            | set(m.copies.loading)
        for pool in (m.device, m.host):
            for b, k in enumerate(pool.key):
                p = self.parent.get(k)
                if k is not None and p is not None and pool.state[b] == BlockState.CACHED and k not in self.private:
                    assert p in present, f"{pool.tier} block {b}: a cached key whose parent was evicted"

    @invariant()
    def integrity(self):
        if self.m.stats.chain_spills > getattr(self, "spills", 0):
            self.spills = self.m.stats.chain_spills
            reached("a running request let go of its chain hold for host room")
        self.m.check_integrity()

    @invariant()
    def keys_point_at_their_bytes(self):
        m = self.m
        for b, k in enumerate(m.device.key):
            if k is not None:
                assert self.dev_data[b] == k, f"device block {b} keyed but holds {self.dev_data[b]!r}"
        for b, k in enumerate(m.host.key):
            if k is not None:
                assert self.host_data[b] == self.private.get(k, k), f"host block {b} keyed but holds wrong bytes"
        for k in m.index.stored:
            assert self.storage.get(k, k) == k, "a stored key's bytes are wrong"

    @invariant()
    def ready_requests_hold_their_tokens(self):
        for rid in self.running():
            req = self.m._reqs[rid]
            for i in range(-(-req.num_computed // BS)):
                assert self.dev_data[req.table[i]] == self.content(rid, i, req.num_computed), \
                    f"request {rid} block {i} holds the wrong KV"

    @invariant()
    def no_strands_without_losses(self):
        """No key in a tier or in storage behind a parent no tier has nor a copy brings, unless
        a loss took that parent or one of its ancestors (it was dropped as their strand): per
        chain, copies in flight or not (one whose bytes only a running request's duplicate block
        holds counts as present: that block takes the key on the request's next insert or free)."""
        if not hasattr(self, "m"):
            return
        m = self.m
        present = set(m.device.lookup) | set(m.host.lookup) | set(m.index.stored)
        if m.stats.skipped_copies > self.skips:  # a host copy not made: the keys that left now went with it
            self.skips = m.stats.skipped_copies
            self.lost |= self.was_present - present
        self.lost.update(m.state.through.skipped)
        self.was_present = present
        coming = present | set(m.copies.inflight) | set(m.copies.loading)
        held = {self.dev_data[b] for req in m._reqs.values() for b in req.table}
        for k in present:
            p = self.parent.get(k)
            if p is None or k in self.private or p in coming or p in held:
                continue
            ancestor = p
            while ancestor is not None and ancestor not in self.lost:
                ancestor = self.parent.get(ancestor)
            assert ancestor is not None, f"key {k.hex()[:8]} stranded behind parent {p.hex()[:8]}, which no loss took"

    def teardown(self):
        """Every copy lands and every request is freed (cached): then every device and host
        block is FREE or CACHED and no copy record is left, whatever the rules left behind."""
        if not hasattr(self, "m"):
            return
        m = self.m
        for _ in range(10_000):
            if self.outstanding:
                self._land(self.outstanding.pop(0), True, count=False)
            elif m._reqs:
                self._free(next(iter(m._reqs)), True)
            else:
                break
            self.check_all()
        assert not m._reqs and not self.outstanding, "the teardown did not drain"
        for pool in (m.device, m.host):
            busy = {b: BlockState(pool.state[b]).name for b in range(pool.capacity)
                    if pool.state[b] not in (BlockState.FREE, BlockState.CACHED)}
            assert not busy, f"{pool.tier} blocks neither free nor cached once every request was freed: {busy}"
        assert not m.copies.records, f"copy records left: {sorted(m.copies.records)}"

    def check_all(self):
        """Every invariant, as hypothesis checks them after a rule."""
        for name in dir(self):
            f = getattr(type(self), name, None)
            if callable(f) and getattr(f, INVARIANT_MARKER, None) is not None:
                getattr(self, name)()


# Every case, from any checkout: targeted rules (a prompt another engine stored, a flood of fresh
# blocks, frees and failures by copy purpose, a lost key of a LOAD in flight) reach each one
# with margin under any seed, not by the luck of the CI profile's fixed examples.
MAX_MISSED = 0


def test_manager_machine():
    """The machine under the active profile; under the CI profile it must reach every case
    but a few (tests/stateful/coverage.py)."""
    run_and_check_coverage(ManagerMachine, set(CASES), REACHED, MAX_MISSED)

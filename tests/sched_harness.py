"""A fake worker and a fake transfer layer that track what every KV slot holds.

Every device slot, host slot and stored block carries a record ``(token, position, digest)``
where ``digest`` fingerprints the whole token prefix up to that position (real KV depends on
all earlier tokens, so a slot computed for another prefix must not pass). The worker checks,
before every step, that each sequence reads slots holding exactly its tokens at those
positions, and writes records for the tokens it computes. The transfer layer moves records
between tiers when a copy completes (in whatever order the test chooses), writes garbage on
failure, and checks that no one wrote a block while a copy was reading it.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.sched.output import StepOutput, StepPlan, validate_plan

GARBAGE = -7
_MASK = (1 << 63) - 1


def run_step(sched, runner, out, outputs: dict) -> None:
    """The rest of a synchronous step ``out`` (copies already handled): finished requests' outputs
    into ``outputs`` and released from ``runner``, then the plan run and its output given back."""
    for r in out.finished:
        outputs[r.request_id] = r.output_token_ids
    runner.release(r.request_id for r in out.finished)
    if out.plan.seqs:
        sched.on_step_output(runner.step(out.plan))


def next_digest(prev: int, token: int, pos: int) -> int:
    return ((prev * 1000003) ^ (token * 7919) ^ (pos << 24) ^ 0x5BD1E995) & _MASK


def sample(rid: int, pos: int, last: int, vocab: int) -> int:
    """The fake model's next token: a fixed function of the request, position and last token."""
    return (rid * 2654435761 + pos * 40503 + last * 97) % 2039 % vocab


class Truth:
    """A request's tokens as the worker knows them, with their prefix digests."""

    __slots__ = ("tokens", "digests")

    def __init__(self, prompt) -> None:
        self.tokens: list[int] = []
        self.digests: list[int] = []
        for t in prompt:
            self.append(int(t))

    def append(self, tok: int) -> None:
        prev = self.digests[-1] if self.digests else 0
        self.digests.append(next_digest(prev, tok, len(self.tokens)))
        self.tokens.append(tok)


@dataclass
class Slots:
    """Records of a tier: ``[blocks, block_size]`` arrays."""

    tok: np.ndarray
    pos: np.ndarray
    dig: np.ndarray

    @classmethod
    def empty(cls, blocks: int, bs: int) -> Slots:
        return cls(np.full((blocks, bs), GARBAGE, np.int64), np.full((blocks, bs), GARBAGE, np.int64),
                   np.zeros((blocks, bs), np.int64))

    def get(self, blocks) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        idx = np.asarray(blocks, np.int64)
        return self.tok[idx].copy(), self.pos[idx].copy(), self.dig[idx].copy()

    def put(self, blocks, rec) -> None:
        idx = np.asarray(blocks, np.int64)
        self.tok[idx], self.pos[idx], self.dig[idx] = rec

    def spoil(self, blocks) -> None:
        idx = np.asarray(blocks, np.int64)
        self.tok[idx] = GARBAGE
        self.pos[idx] = GARBAGE


class FakeWorker:
    def __init__(self, num_blocks: int, block_size: int, vocab: int = 64) -> None:
        self.bs = block_size
        self.num_blocks = num_blocks
        self.vocab = vocab
        self.dev = Slots.empty(num_blocks, block_size)
        self.truth: dict[int, Truth] = {}
        self.reads = 0  # slots verified
        # the weights the fake model runs: stamped into every digest it writes, so a read of KV
        # computed under older weights (a stale hit) fails check_prefix like wrong tokens
        self.weights_version = 0

    def add(self, rid: int, prompt, outputs=()) -> None:
        t = Truth(prompt)
        for o in outputs:
            t.append(int(o))
        self.truth[rid] = t

    def check_prefix(self, rid: int, table: np.ndarray, n: int, what: str) -> None:
        """Positions 0..n-1 of ``rid`` hold exactly its tokens (and prefixes) in ``table``'s slots."""
        if n == 0:
            return
        t = self.truth[rid]
        pos = np.arange(n)
        blk = table[pos // self.bs].astype(np.int64)
        slot = pos % self.bs
        tok, p, dig = self.dev.tok[blk, slot], self.dev.pos[blk, slot], self.dev.dig[blk, slot]
        want_tok = np.asarray(t.tokens[:n], np.int64)
        want_dig = np.asarray(t.digests[:n], np.int64) ^ self._stamp()
        bad = np.flatnonzero((tok != want_tok) | (p != pos) | (dig != want_dig))
        if len(bad):
            i = int(bad[0])
            stale = tok[i] == want_tok[i] and p[i] == i and dig[i] != want_dig[i]
            raise AssertionError(f"{what}: request {rid} position {i} (block {int(blk[i])} slot {i % self.bs}) "
                                 f"holds token {int(tok[i])} at position {int(p[i])}, expected token "
                                 f"{int(want_tok[i])}{' (computed under older weights)' if stale else ''}; "
                                 f"{len(bad)} bad slots")
        self.reads += n

    def write(self, rid: int, table: np.ndarray, start: int, end: int) -> None:
        t = self.truth[rid]
        pos = np.arange(start, end)
        blk = table[pos // self.bs].astype(np.int64)
        slot = pos % self.bs
        self.dev.tok[blk, slot] = t.tokens[start:end]
        self.dev.pos[blk, slot] = pos
        self.dev.dig[blk, slot] = np.asarray(t.digests[start:end], np.int64) ^ self._stamp()

    def _stamp(self) -> int:
        return self.weights_version << 40

    def step(self, plan: StepPlan, busy: set[int] = frozenset()) -> StepOutput:
        validate_plan(plan, self.bs, self.num_blocks)
        sampled = {}
        for seq in plan.seqs:
            rid, start, end = seq.request_id, seq.start_pos, seq.end_pos
            t = self.truth[rid]
            assert end <= len(t.tokens), f"request {rid}: step computes up to {end}, it has {len(t.tokens)} tokens"
            fed = seq.token_ids.tolist()
            assert fed == t.tokens[start:end], f"request {rid}: fed {fed} at {start}, its tokens are " \
                                               f"{t.tokens[start:end]}"
            self.check_prefix(rid, seq.block_table, start, f"step {plan.step_id}")
            written = {int(seq.block_table[p // self.bs]) for p in range(start, end)}
            assert not written & busy, f"step {plan.step_id}: request {rid} writes blocks {written & busy} " \
                                       f"that a copy in flight reads or writes"
        for seq in plan.seqs:
            self.write(seq.request_id, seq.block_table, seq.start_pos, seq.end_pos)
            if seq.sample:
                t = self.truth[seq.request_id]
                assert seq.end_pos == len(t.tokens), f"request {seq.request_id}: sampled before its last token"
                tok = sample(seq.request_id, seq.end_pos, t.tokens[-1], self.vocab)
                t.append(tok)
                sampled[seq.request_id] = tok
        return StepOutput(plan.step_id, sampled, 0.001)


class FakeTransfer:
    """Copies records when told a plan completed. Sources are snapshotted at dispatch and must be
    unchanged at completion: nobody may write a block that a copy reads."""

    def __init__(self, worker: FakeWorker, num_host_blocks: int) -> None:
        self.worker = worker
        self.host = Slots.empty(max(num_host_blocks, 1), worker.bs)
        self.storage: dict[bytes, tuple[np.ndarray, np.ndarray, np.ndarray]] = {}
        self.pending: list[tuple[CopyPlan, tuple | None]] = []
        self.failed_swap_in_dst: set[int] = set()  # device blocks a failed SWAP_IN left garbage in
        self.free_on_clear = True  # CLEAR releases both tiers (their old KV is gone); False: it stays readable

    def dispatch(self, plans) -> None:
        for p in plans:
            self.pending.append((p, self._read_src(p)))

    def _read_src(self, p: CopyPlan):
        k = p.kind
        if k is CopyKind.SWAP_OUT:
            return self.worker.dev.get(p.src)
        if k in (CopyKind.SWAP_IN, CopyKind.STORE):
            return self.host.get(p.src)
        return None

    def busy_device_blocks(self) -> set[int]:
        out: set[int] = set()
        for p, _ in self.pending:
            if p.kind is CopyKind.SWAP_OUT:
                out.update(p.src.tolist())
            elif p.kind is CopyKind.SWAP_IN:
                out.update(p.dst.tolist())
        return out

    def complete(self, index: int, ok: bool) -> tuple[CopyPlan, bool]:
        """Execute pending plan ``index`` (all at once, as if it had run meanwhile); returns it and
        its outcome (a LOAD of a key storage lacks fails)."""
        p, snap = self.pending.pop(index)
        k = p.kind
        if snap is not None:
            now = self._read_src(p)
            for a, b in zip(snap, now, strict=True):
                assert np.array_equal(a, b), f"plan {p.plan_id} ({k.name}): its source blocks " \
                                             f"{p.src.tolist()} changed while it was in flight"
        if k is CopyKind.LOAD and ok:
            ok = all(key in self.storage for key in p.keys)
        if k is CopyKind.SWAP_OUT:
            self.host.put(p.dst, snap) if ok else self.host.spoil(p.dst)
        elif k is CopyKind.SWAP_IN:
            if ok:
                self.worker.dev.put(p.dst, snap)
            else:
                self.worker.dev.spoil(p.dst)
                self.failed_swap_in_dst.update(p.dst.tolist())
        elif k is CopyKind.STORE:
            if ok:
                for i, key in enumerate(p.keys):
                    self.storage[key] = tuple(a[i].copy() for a in snap)
        elif k is CopyKind.LOAD:
            if ok:
                for hb, key in zip(p.dst.tolist(), p.keys, strict=True):
                    self.host.put([hb], tuple(a[None] for a in self.storage[key]))
            else:
                self.host.spoil(p.dst)
        elif k is CopyKind.CLEAR and self.free_on_clear:  # free_memory: the tiers' pages come back as zeros
            self.worker.dev.spoil(np.arange(self.worker.num_blocks))
            self.host.spoil(np.arange(len(self.host.tok)))
        return p, ok


class Rig:
    """Scheduler + cache manager + fake worker + fake transfer, driven step by step."""

    def __init__(self, sched, vocab: int = 64) -> None:
        from fastkv.sched.request import Request  # noqa: F401 - the type add() builds

        self.sched = sched
        cache = sched.cache
        self.worker = FakeWorker(cache.config.num_device_blocks, cache.block_size, vocab)
        self.transfer = FakeTransfer(self.worker, cache.config.num_host_blocks)
        self.finished: dict[int, object] = {}
        self.steps = 0

    def add(self, rid: int, prompt, max_new_tokens: int = 4, **kw):
        from fastkv.sched.request import Request

        req = Request(rid, np.asarray(prompt, np.int32), max_new_tokens, **kw)
        self.worker.add(rid, req.prompt_token_ids, req.output_token_ids)
        self.sched.add_request(req)
        return req

    def step(self, check: bool = True):
        s = self.sched
        out = s.step()
        self.transfer.dispatch(out.copies)
        for r in out.finished:
            self.finished[r.request_id] = r
        if out.plan.seqs:
            s.on_step_output(self.worker.step(out.plan, self.transfer.busy_device_blocks()))
            self.steps += 1
        if check:
            s.check_integrity()
        return out

    def complete(self, index: int = 0, ok: bool = True) -> None:
        plan, ok = self.transfer.complete(index, ok)
        self.sched.on_copy_complete(plan, ok)
        self.sched.check_integrity()

    def complete_all(self, ok: bool = True) -> None:
        while self.transfer.pending:
            self.complete(0, ok)

    def run(self, max_steps: int = 10_000, copies: bool = True) -> None:
        """Step (completing every copy, FIFO, when ``copies``) until the scheduler is idle."""
        for _ in range(max_steps):
            if not self.sched.has_work() and not self.transfer.pending:
                return
            self.step()
            if copies:
                self.complete_all()
        raise AssertionError(f"not idle after {max_steps} steps: {self.sched.counts()}")

"""Storage lookup at admission: ask the shared store what it holds before a request is queued.

The storage tier is a pool that outlives this engine (a restart, or another engine on the
same LMDB directory or Redis), so the cache index cannot know what it holds from this
engine's own writes. A new request is parked here instead of going straight to the
scheduler (unless it could load nothing: its cache policy may not read storage, or the hit
policy is ``recompute``); every engine step turns the parked requests not yet asked into one
LOOKUP task per admission wave (every rank gets the same task: one round trip per rank), naming for
each request the keys of its prompt past the device, host and known-stored match. Each
rank answers, per request, the run of those keys its shard holds (``fastkv.storage.lookup``);
the run every rank confirms joins the cache index as stored, so the request's admission
LOADs those blocks into host staging blocks and swaps them in (``CacheManager.allocate``,
bounded by the scheduler's ``max_loading_blocks``). A value that vanished or fails its
checksum by then fails the LOAD: a miss, and the request recomputes from that block.

The scheduler never waits on a lookup. A parked request goes to the scheduler once its
lookup is answered, or once the prefetch policy's wait for it is over (``fastkv.sched.prefetch``:
by default ``timeout_s`` after it was parked), whichever comes first (it then goes with what is
confirmed, never worse than without a lookup). Under ``timeout``, where this machine's lookups
take longer than that (a busy machine), the wait stretches to twice their recent round trip,
at most ten times the setting (``deadline``). Requests leave in the order they came, so FCFS
holds: a late lookup delays the ones behind it, within the same bound. A failed LOOKUP (a
rank down, storage unavailable) confirms nothing. With async scheduling the engine waits for
a wave's answers before its next plan while the step in flight runs
(``Engine._await_lookups``): the requests join that plan, not the one after it.
"""
from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fastkv.cache.manager import CacheManager
from fastkv.cache.plan import LookupTask
from fastkv.ipc import DoneMsg
from fastkv.sched.prefetch import lookup_wait_s
from fastkv.sched.request import Request
from fastkv.storage.lookup import confirmed

TASK_ID_BASE = 1 << 48  # far above the cache's plan ids, which count from 1
MAX_KEYS_PER_TASK = 4096  # 128 KiB of keys: a wave larger than this goes as several tasks
RTT_ALPHA = 0.2  # weight of a new round trip in rtt_s
RTT_SLACK = 2.0  # a request waits for this many round trips where lookups take longer than its wait
STRETCH_MAX = 10.0  # ... and at most this many times its wait


@dataclass(slots=True, eq=False)
class _Parked:
    req: Request
    parked: float
    wait: float  # the prefetch policy's bound, before any stretch (StorageLookup.deadline)
    asked: bool = False
    answered: bool = False
    aborted: bool = False


@dataclass(slots=True)
class _Wave:
    chains: list[tuple[_Parked, list[bytes]]]
    sent: float
    found: dict[int, np.ndarray] = field(default_factory=dict)  # rank -> found per chain


@dataclass(slots=True)
class LookupStats:
    lookups: int = 0  # LOOKUP tasks sent (each to every rank)
    requests: int = 0  # requests that had keys to ask about
    keys_asked: int = 0
    keys_found: int = 0  # confirmed by every rank
    failed: int = 0  # LOOKUP tasks that failed (nothing confirmed)
    timed_out: int = 0  # requests released before their answer came
    seconds: float = 0.0  # summed round trips of answered tasks
    answered: int = 0

    def to_json(self) -> dict[str, float]:
        d = {name: getattr(self, name) for name in self.__slots__}
        d["latency_ms_mean"] = 1e3 * self.seconds / self.answered if self.answered else 0.0
        return d


class StorageLookup:
    """Parks new requests until their storage lookup is answered or times out (module docstring)."""

    def __init__(self, cache: CacheManager, timeout_s: float, max_keys: int = MAX_KEYS_PER_TASK,
                 clock: Callable[[], float] = time.monotonic, policy: str = "timeout",
                 per_1k_tokens_s: float = 0.0) -> None:
        if not timeout_s >= 0 or not per_1k_tokens_s >= 0:
            raise ValueError(f"storage lookup timeouts must be >= 0 s, got {timeout_s!r} + {per_1k_tokens_s!r} "
                             "per 1k tokens")
        lookup_wait_s(policy, 0.0, 0.0, 0)  # an unknown policy fails here
        self.cache, self.timeout_s, self.clock = cache, float(timeout_s), clock
        self.policy, self.per_1k_tokens_s = policy, float(per_1k_tokens_s)
        self.max_keys = max(1, min(max_keys, MAX_KEYS_PER_TASK))
        self.stats = LookupStats()
        self.rtt_s = 0.0  # answered LOOKUPs' round trip (EWMA; 0: none yet)
        self._parked: deque[_Parked] = deque()
        self._by_id: dict[int, _Parked] = {}
        self._waves: dict[int, _Wave] = {}
        self._next_id = TASK_ID_BASE

    def __len__(self) -> int:
        return len(self._parked)

    def requests(self) -> list[Request]:
        return [p.req for p in self._parked]

    def park(self, req: Request) -> None:
        if req.arrival_time is None:  # its wait here counts toward its TTFT
            req.arrival_time = self.clock()
        p = _Parked(req, self.clock(), lookup_wait_s(self.policy, self.timeout_s, self.per_1k_tokens_s,
                                                     req.num_tokens))
        self._parked.append(p)
        self._by_id[req.request_id] = p

    def abort(self, request_id: int) -> bool:
        """Marks a parked request aborted (the scheduler aborts it on release); False if not parked."""
        p = self._by_id.get(request_id)
        if p is None or p.aborted:
            return False
        p.aborted = True
        return True

    def owns(self, task_id: int) -> bool:
        return task_id in self._waves

    # ------------------------------------------------------------------ the wave
    def wave(self) -> list[LookupTask]:
        """LOOKUP plans for every parked request not asked yet (usually one plan)."""
        chains: list[tuple[_Parked, list[bytes]]] = []
        for p in self._parked:
            if p.asked:
                continue
            p.asked = True
            rest = self._unknown_keys(p.req)[:self.max_keys]
            if rest:
                chains.append((p, rest))
            else:
                p.answered = True
        plans, batch, nkeys = [], [], 0
        for chain in chains:
            if batch and nkeys + len(chain[1]) > self.max_keys:
                plans.append(self._send(batch))
                batch, nkeys = [], 0
            batch.append(chain)
            nkeys += len(chain[1])
        if batch:
            plans.append(self._send(batch))
        return plans

    def _unknown_keys(self, req: Request) -> list[bytes]:
        """Its prompt's keys past the device, host and known-stored match (the last token never hits)."""
        tokens = req.token_ids
        m = self.cache.match(tokens, req.extra)
        keys = self.cache.keys_for(tokens, req.extra)[:(len(tokens) - 1) // self.cache.block_size]
        return keys[m.num_blocks:]

    def _send(self, chains: list[tuple[_Parked, list[bytes]]]) -> LookupTask:
        task_id = self._next_id
        self._next_id += 1
        lengths = np.array([len(keys) for _, keys in chains], np.int32)
        keys = tuple(k for _, chain in chains for k in chain)
        self._waves[task_id] = _Wave(chains, self.clock())
        self.stats.lookups += 1
        self.stats.requests += len(chains)
        self.stats.keys_asked += len(keys)
        return LookupTask(task_id, lengths, keys)

    # ------------------------------------------------------------------ answers
    def on_ack(self, msg: DoneMsg) -> None:
        """One rank's ack of a LOOKUP (before the transfer client gathers it)."""
        wave = self._waves.get(msg.task_id)
        found = msg.found_counts
        if wave is not None and msg.ok and len(found) == len(wave.chains):
            wave.found[msg.rank] = found

    def complete(self, task_id: int, ok: bool, tp_size: int) -> None:
        """Every rank answered (or failed): the confirmed keys join the index as stored."""
        wave = self._waves.pop(task_id)
        st = self.stats
        if ok and len(wave.found) == tp_size:
            rtt = self.clock() - wave.sent
            st.answered += 1
            st.seconds += rtt
            self.rtt_s += (RTT_ALPHA if self.rtt_s else 1.0) * (rtt - self.rtt_s)
            found = confirmed(list(wave.found.values()), len(wave.chains))
        else:
            st.failed += 1
            found = np.zeros(len(wave.chains), np.int32)
        for (p, keys), n in zip(wave.chains, found.tolist(), strict=True):
            self.cache.confirm_stored(keys[:n])
            st.keys_found += n
            p.answered = True

    def release(self) -> list[tuple[Request, bool]]:
        """Parked requests that may go to the scheduler now, in arrival order, each with
        whether it was aborted while parked."""
        now, out = self.clock(), []
        while self._parked:
            p = self._parked[0]
            if not p.answered:
                if now < self.deadline(p):
                    break
                self.stats.timed_out += 1
            self._parked.popleft()
            del self._by_id[p.req.request_id]
            out.append((p.req, p.aborted))
        return out

    def blocked(self) -> bool:
        """The head request waits for its answer (``release`` holds it and those behind it)."""
        return bool(self._parked) and not self._parked[0].answered

    def wait_s(self, limit: float) -> float:
        """How long the engine may block for copies before the head request's deadline."""
        if not self._parked or self._parked[0].answered:
            return limit
        return max(0.0, min(limit, self.deadline(self._parked[0]) - self.clock()))

    def deadline(self, p: _Parked) -> float:
        """When ``p`` goes without its answer: the prefetch policy's wait, stretched under the
        ``timeout`` policy to ``RTT_SLACK`` of the recent round trips where lookups take longer
        (at most ``STRETCH_MAX`` times the wait): a request released before its answer recomputes
        all the answer would have let it load, which on a busy machine is most of its prompt."""
        wait = p.wait
        if self.policy == "timeout" and self.rtt_s > wait:
            wait = min(RTT_SLACK * self.rtt_s, STRETCH_MAX * wait)
        return p.parked + wait

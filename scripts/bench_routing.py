#!/usr/bin/env python
"""KV-aware routing, measured: ``--engines`` engines (default 2) behind a router, under the GPU
cost model, with three routing policies side by side, on one of two workloads:

- ``--workload trace`` (default): the Mooncake conversation trace (fastkv/data), whose reuse is
  mostly inside conversations;
- ``--workload shared``: prefixes shared across users, the case a KV-aware router exists for.
  ``--docs`` system prompts / documents of 1-8k tokens (log-uniform), each conversation on one
  of them (Zipf-popular, s=1.1) from one of ``--users`` users, 1-4 turns: a turn's prompt is the
  document, the earlier turns' questions and answers, and a new question of 64-256 tokens;
  answers of 64-256 tokens; conversations start as a Poisson process of ``--rate`` requests/s
  overall, a turn 1-4 s after the one before (open loop: it does not wait for the answer).
  The default rate is meant to overload round robin's engines, so that tokens/s measures what
  each routing lets the engines serve. Its default host tier is twice the device's: the
  documents and conversations outgrow one engine's tiers but not four engines' together,
  which is when routing decides how much of the working set the fleet holds (with a host tier
  big enough to hold everything on every engine, any routing hits nearly as often).

Policies:

- ``round_robin``: request i goes to engine i mod N;
- ``session``: a hash of the request's conversation picks the engine: sticky sessions. The
  shared workload knows its conversations; the trace has no session ids: a request continues
  the conversation of the earlier request whose prompt (but its last, partial 512-token block)
  is the longest its own starts with, if no other request continued it yet (a conversation is
  a chain of turns; requests that share only a system prompt start conversations of their own);
- ``indexer``: the reference indexer (fastkv.routing.indexer), fed by every engine's KV events
  over ZMQ, gives each engine's longest cached prefix of the prompt per tier
  (fastkv.routing.block_hashes), and ``--score`` weighs it against each engine's load:

  - ``share`` (the trace's default): cached prompt share (device blocks count 1, host blocks
    ``--host-weight``) less ``--load-weight`` per unfinished request beyond the least loaded
    engine's (as llm-d's precise prefix-cache scorer beside its load scorer);
  - ``work`` (the shared workload's default): the engine whose prefill work is least, in prompt
    tokens: this prompt's tokens not cached there (a host-cached block costs ``1 -
    --host-weight`` of a computed one) plus the engine's backlog: the same estimate for every
    request routed to it whose first token is not out yet, and ``--load-tokens`` per unfinished
    request (its decode's share of the steps).

The engines run in-process as libraries (scheduler and cache manager, no worker processes) in a
discrete-event simulation: each step takes the GPU time ``--cost-model`` gives it (a roofline of
Llama-3-8B on an H100 SXM: fastkv.deploy.cost_model), each copy its PCIe time plus a
fixed latency, and the engines step in parallel, each on its own GPU. Time is simulated, so
the runs are deterministic and need not interleave. Before each routing decision the indexer
takes every batch the engines have published (``Indexer.sync``: what a router with a few
milliseconds of event lag would know a few steps later).

Reported per policy: prompt-token hit ratio per tier (device, host) over all engines, TTFT p50
and p99 (simulated seconds), tokens/s (generated tokens over the simulated makespan), and the
requests each engine served. The LAST line is JSON:

    {"bench": "routing", "requests": N, "cost_model": NAME,
     "hit_ratio": {"round_robin": {"device": ..., "host": ...}, "session": {...}, "indexer": {...}},
     "ttft_p50_s": {"round_robin": ..., "session": ..., "indexer": ...}, "ttft_p99_s": {...},
     "tokens_per_s": {...}, "per_engine": {"round_robin": {"e0": n0, "e1": n1, ...}, ...}}

``--quick``: 500 requests; ``--smoke``: 24 requests (tests); default 1000 (trace), 3000 (shared).
"""
from __future__ import annotations

import argparse
import heapq
import json
import sys
import tempfile
import zlib
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from fastkv.cache.manager import CacheConfig, CacheManager  # noqa: E402
from fastkv.cache.write_policy import WritePolicy  # noqa: E402
from fastkv.cli import at_least  # noqa: E402
from fastkv.deploy.cost_model import DEPLOYMENTS, LLAMA3_8B_H100, deployment  # noqa: E402
from fastkv.events import EventsConfig, KVEvents  # noqa: E402
from fastkv.routing import block_hashes  # noqa: E402
from fastkv.routing.indexer import Indexer  # noqa: E402
from fastkv.sched import PreemptionMode, Scheduler, SchedulerConfig  # noqa: E402
from fastkv.sched.output import StepOutput  # noqa: E402
from fastkv.sched.request import Request  # noqa: E402
from fastkv.workload import TRACE, open_trace, trace  # noqa: E402

POLICIES = ("round_robin", "session", "indexer")
BLOCK = 16
COPY_LATENCY_S = 10e-6  # a cudaMemcpyAsync's fixed cost


def sessions(n: int, start: int = 0) -> list[int]:
    """A conversation id per trace request (module docstring)."""
    out: list[int] = []
    seen: dict[tuple, int] = {}  # a prompt's full 512-token blocks -> its session
    with open_trace(TRACE) as f:
        for i, line in enumerate(f):
            if i < start:
                continue
            if i >= start + n:
                break
            ids = tuple(json.loads(line)["hash_ids"])
            sid = len(out)
            for k in range(len(ids) - 1, 0, -1):  # the longest earlier prompt this one extends
                if ids[:k] in seen:
                    sid = seen.pop(ids[:k])
                    break
            seen[ids[:-1]] = sid
            out.append(sid)
    return out


class SimEngine:
    """Scheduler + cache manager of one engine, timed by the cost model."""

    def __init__(self, name: str, dep, device_blocks: int, host_blocks: int, events: EventsConfig) -> None:
        self.name = name
        self.dep = dep
        self.cache = CacheManager(CacheConfig(num_device_blocks=device_blocks, num_host_blocks=host_blocks,
                                              block_size=BLOCK, policy=WritePolicy.WRITE_THROUGH))
        self.sched = Scheduler(self.cache, SchedulerConfig(preemption=PreemptionMode.OFFLOAD,
                                                           max_num_batched_tokens=2048))
        self.events = KVEvents(self.cache, events)
        self.clock = 0.0  # when this engine's GPU is free
        self.copies: list[tuple[float, int, object]] = []  # (done at, plan id, plan)
        self.arrival: dict[int, float] = {}
        self.first: dict[int, float] = {}
        self.done: dict[int, float] = {}
        self.generated = 0
        self.served = 0
        self.pending: dict[int, float] = {}  # routed, first token not out: the router's prefill estimate
        self.copy_s_per_block = dep.copy_seconds_per_token() * BLOCK

    def add(self, rid: int, prompt: list[int], max_new: int, now: float, work: float = 0.0) -> None:
        self.clock = max(self.clock, now)
        self.arrival[rid] = now
        self.pending[rid] = work
        self.served += 1
        self.sched.add_request(Request(rid, np.asarray(prompt, np.int32), max_new))

    @property
    def unfinished(self) -> int:
        return len(self.arrival) - len(self.done)

    def busy(self) -> bool:
        return self.sched.has_work() or bool(self.copies)

    def step(self) -> None:
        """One step at ``clock``: copies done by then complete first."""
        now = self.clock
        while self.copies and self.copies[0][0] <= now:
            _, _, plan = heapq.heappop(self.copies)
            self.sched.on_copy_complete(plan, True)
        out = self.sched.step()
        for plan in out.copies:
            n = max(len(plan.src), len(plan.dst))
            heapq.heappush(self.copies, (now + COPY_LATENCY_S + n * self.copy_s_per_block, plan.plan_id, plan))
        for r in out.finished:
            self.done.setdefault(r.request_id, now)
        if out.plan.seqs:
            dt = self.dep.step_seconds((s.start_pos, s.end_pos) for s in out.plan.seqs)
            sampled = {}
            for s in out.plan.seqs:
                if s.sample:
                    sampled[s.request_id] = (s.request_id * 7919 + s.end_pos * 31) % 1000 + 1
                    self.first.setdefault(s.request_id, now + dt)
                    self.pending.pop(s.request_id, None)
            self.generated += len(sampled)
            self.sched.on_step_output(StepOutput(out.plan.step_id, sampled, dt))
            self.clock = now + dt
        elif self.copies:
            self.clock = max(now, self.copies[0][0])
        self.events.flush()

    def hits(self) -> tuple[int, int, int]:
        st = self.cache.stats
        return st.prompt_tokens, st.device_hit_tokens, st.host_hit_tokens


def simulate(policy: str, reqs: list[dict], sess: list[int], args, root: Path) -> dict:
    dep = deployment(args.cost_model)
    engines, idx = [], Indexer()
    try:
        for e in range(args.engines):
            cfg = EventsConfig(endpoint=f"ipc://{root}/{policy}{e}.pub", replay_endpoint=f"ipc://{root}/{policy}{e}.rep",
                               buffer_steps=1 << 20)
            engines.append(SimEngine(f"e{e}", dep, args.device_blocks, args.host_blocks, cfg))
            idx.add(f"e{e}", cfg.endpoint, cfg.replay_endpoint)
        ns = engines[0].cache.namespace
        i = 0
        while i < len(reqs) or any(e.busy() for e in engines):
            nxt = min((e for e in engines if e.busy()), key=lambda e: e.clock, default=None)
            if i < len(reqs) and (nxt is None or reqs[i]["arrival_s"] <= nxt.clock):
                r = reqs[i]
                now = r["arrival_s"]
                work = 0.0
                if policy == "round_robin":
                    pick = i % len(engines)
                elif policy == "session":
                    pick = zlib.crc32(str(sess[i]).encode()) % len(engines)
                else:
                    idx.sync()
                    pick, work = choose(idx, engines, block_hashes(r["prompt"], ns, BLOCK), len(r["prompt"]), args)
                engines[pick].add(i, r["prompt"], r["max_new_tokens"], now, work)
                i += 1
            else:
                nxt.step()
        ttft = np.array([e.first[rid] - e.arrival[rid] for e in engines for rid in e.arrival])
        end = max(max(e.done.values(), default=0.0) for e in engines)
        prompt, dev, host = (sum(x) for x in zip(*(e.hits() for e in engines), strict=True))
        return {"hit_ratio": {"device": dev / prompt, "host": host / prompt},
                "ttft_p50_s": float(np.percentile(ttft, 50)), "ttft_p99_s": float(np.percentile(ttft, 99)),
                "tokens_per_s": sum(e.generated for e in engines) / (end - reqs[0]["arrival_s"]),
                "per_engine": [e.served for e in engines],
                "events": [e.events.stats()["batches"] for e in engines]}
    finally:
        for e in engines:
            e.events.close()
        idx.close()


def choose(idx: Indexer, engines: list[SimEngine], hashes: list[bytes], prompt_len: int, args) -> tuple[int, float]:
    """The indexer's pick, and its estimate of the prompt tokens that engine computes (module docstring)."""
    prefix = idx.longest_prefix(hashes)
    least = min(e.unfinished for e in engines)
    n = max(len(hashes), 1)
    best, pick, pick_work = None, 0, 0.0
    for k, e in enumerate(engines):
        p = prefix[e.name]
        cached = p.gpu + args.host_weight * (p.total - p.gpu)  # in blocks, a host block worth host_weight
        work = prompt_len - BLOCK * cached
        if args.score == "share":
            score = cached / n - args.load_weight * (e.unfinished - least)
        else:
            score = -(work + sum(e.pending.values()) + args.load_tokens * e.unfinished)
        if best is None or score > best:
            best, pick, pick_work = score, k, work
    return pick, pick_work


def shared(n: int, args, seed: int = 0) -> tuple[list[dict], list[int]]:
    """The shared-prefix workload (module docstring): requests by arrival, and each one's conversation."""
    rng = np.random.default_rng(seed)
    docs = [rng.integers(0, 32_000, int(np.exp(rng.uniform(np.log(1024), np.log(8192))))).tolist()
            for _ in range(args.docs)]
    popularity = 1.0 / np.arange(1, args.docs + 1) ** 1.1
    popularity /= popularity.sum()
    user_doc = rng.choice(args.docs, size=args.users, p=popularity)
    out: list[tuple[float, int, dict]] = []
    t, conv = 0.0, 0
    while len(out) < n:
        t += rng.exponential(1.0 / args.rate) * 2.5  # 2.5 turns per conversation on average
        user = int(rng.integers(args.users))
        prompt = list(docs[user_doc[user]])
        at = t
        for _turn in range(int(rng.integers(1, 5))):
            prompt = prompt + rng.integers(0, 32_000, int(rng.integers(64, 257))).tolist()
            answer = int(rng.integers(64, 257))
            out.append((at, conv, {"prompt": prompt, "max_new_tokens": answer}))
            prompt = prompt + rng.integers(0, 32_000, answer).tolist()  # the answer, as the next turn sends it
            at += rng.uniform(1.0, 4.0)
        conv += 1
    out.sort(key=lambda x: x[0])
    out = out[:n]
    reqs = [{**r, "arrival_s": at} for at, _, r in out]
    return reqs, [c for _, c, _ in out]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="500 trace requests")
    p.add_argument("--smoke", action="store_true", help="24 trace requests (tests: numbers mean nothing)")
    p.add_argument("--workload", choices=("trace", "shared"), default="trace",
                   help="trace: the Mooncake conversation trace; shared: prefixes shared across users (docstring)")
    p.add_argument("--engines", type=at_least(2), default=2, help="engines behind the router (default 2)")
    p.add_argument("--requests", type=at_least(2), help="requests (default 1000 trace, 3000 shared)")
    p.add_argument("--docs", type=at_least(1), default=48, help="shared: system prompts / documents (default 48)")
    p.add_argument("--users", type=at_least(1), default=1000, help="shared: users (default 1000)")
    p.add_argument("--rate", type=at_least(0.001, float), default=60.0,
                   help="shared: requests per second over all engines (default 60)")
    p.add_argument("--score", choices=("share", "work"),
                   help="indexer's score (docstring; default share for the trace, work for shared)")
    p.add_argument("--load-tokens", type=at_least(0.0, float), default=256.0,
                   help="work score: an unfinished request's load in prompt tokens (default 256)")
    p.add_argument("--speedup", type=at_least(0.001, float), default=20.0,
                   help="trace: arrivals this many times faster than the trace's (default 20: both engines busy)")
    p.add_argument("--tokens-per-id", type=at_least(1), default=32,
                   help="trace: tokens per 512-token trace block (default 32: prompts scaled down 16x)")
    p.add_argument("--device-blocks", type=at_least(16), default=2048, help=f"per engine, of {BLOCK} tokens")
    p.add_argument("--host-blocks", type=at_least(0),
                   help="per engine (default 32768 for the trace: 16x the device's; 4096 for shared: 2x, docstring)")
    p.add_argument("--cost-model", default=LLAMA3_8B_H100.name, choices=sorted(DEPLOYMENTS))
    p.add_argument("--host-weight", type=at_least(0.0, float), default=0.8,
                   help="a host-cached block's worth against a device-cached one (default 0.8, llm-d's cpu tier)")
    p.add_argument("--load-weight", type=at_least(0.0, float), default=0.05,
                   help="score lost per unfinished request beyond the least loaded engine's (default 0.05)")
    args = p.parse_args()
    args.score = args.score or ("work" if args.workload == "shared" else "share")
    if args.host_blocks is None:
        args.host_blocks = 4096 if args.workload == "shared" else 32768
    n = args.requests or (24 if args.smoke else 500 if args.quick else 3000 if args.workload == "shared" else 1000)
    if args.workload == "shared":
        reqs, sess = shared(n, args)
        what = f"shared workload: {args.docs} documents, {args.users} users, {args.rate} requests/s"
    else:
        reqs = trace(n, tokens_per_id=args.tokens_per_id, max_new_tokens=512, speedup=args.speedup)
        sess = sessions(n)
        what = f"trace, arrivals {args.speedup}x the trace's"
    print(f"{n} requests ({len(set(sess))} conversations), {sum(len(r['prompt']) for r in reqs)} prompt "
          f"tokens; {args.engines} engines of {args.device_blocks} device / {args.host_blocks} host blocks of "
          f"{BLOCK} tokens; {args.cost_model}; {what}; indexer score {args.score}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="fastkv-bench-routing-") as root:
        for policy in POLICIES:
            results[policy] = simulate(policy, reqs, sess, args, Path(root))
    print("\n| policy | hit % device | hit % host | TTFT p50 ms | TTFT p99 ms | tokens/s | requests per engine |")
    print("|---|---|---|---|---|---|---|")
    for policy, d in results.items():
        h = d["hit_ratio"]
        print(f"| {policy} | {100 * h['device']:.1f} | {100 * h['host']:.1f} | {1e3 * d['ttft_p50_s']:.1f} | "
              f"{1e3 * d['ttft_p99_s']:.1f} | {d['tokens_per_s']:.0f} | {' / '.join(map(str, d['per_engine']))} |")
    rr, ss, ix = results["round_robin"], results["session"], results["indexer"]
    print(f"\nindexer against round robin: device+host hit {100 * sum(ix['hit_ratio'].values()):.1f} % vs "
          f"{100 * sum(rr['hit_ratio'].values()):.1f} %, TTFT p50 {1e3 * ix['ttft_p50_s']:.1f} vs "
          f"{1e3 * rr['ttft_p50_s']:.1f} ms; TTFT p50 against sessions {ix['ttft_p50_s'] / ss['ttft_p50_s']:.2f}x, "
          f"tokens/s against round robin {ix['tokens_per_s'] / rr['tokens_per_s']:.2f}x")
    print(json.dumps({
        "bench": "routing", "requests": n, "cost_model": args.cost_model,
        "hit_ratio": {m: {t: round(v, 4) for t, v in d["hit_ratio"].items()} for m, d in results.items()},
        "ttft_p50_s": {m: round(d["ttft_p50_s"], 5) for m, d in results.items()},
        "ttft_p99_s": {m: round(d["ttft_p99_s"], 5) for m, d in results.items()},
        "tokens_per_s": {m: round(d["tokens_per_s"], 1) for m, d in results.items()},
        "per_engine": {m: {f"e{i}": n for i, n in enumerate(d["per_engine"])} for m, d in results.items()},
    }))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""KV cache groups on a sliding-window hybrid: the same model, the same device tier bytes,
cached by groups or as if every layer were full attention.

The model is ``gpt-oss-20b-h100-sxm`` of the cost model (24 layers, every other one a 128-token
window). A long-context workload (``--requests`` prompts of ``--prompt`` tokens, families of
``--share`` sharing a prefix longer than the window, ``--output`` tokens each) runs on the group
core (``fastkv.cache.groups.GroupedCache``) twice over a device tier of ``--device-gb``: cached
by groups (a full and a sliding group, the tier split by ``split_device_tier``), and as one
full group. A small continuous-batching loop here admits in order while every group has room,
gives each step ``--budget`` tokens (decodes first, then prefill chunks of up to ``--chunk``),
and preempts the newest request (recompute) when a group runs out. Each step's time is the
deployment's roofline (``Deployment.step_seconds``), added to a simulated clock: nothing is
waited out, so the figures do not depend on this machine's load; its wall time is that of
the bookkeeping.

Outputs are checked: the KV of position p is a function of tokens 0..p, written through each
group's table; each sampled token is a function of what the model's full layers and its
sliding layers read through the tables, and must equal the same function over the cache-free
values (``outputs_identical``: both caches give the cache-free tokens). The last line is

    {"bench": "hybrid", "requests_in_flight": {"hybrid": .., "all_full": ..}, "tokens_per_s":
     {"hybrid": .., "all_full": ..}, "kv_bytes_per_request": {"hybrid": .., "all_full": ..},
     "outputs_identical": true, "speedup": ..}

with ``requests_in_flight`` the mean batch of the decode steps and ``tokens_per_s`` generated
tokens over simulated GPU seconds. Goal: hybrid >= 1.5 x all_full.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections import deque
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.cache.groups import GroupedCache, split_device_tier  # noqa: E402
from fastkv.cache.keys import as_tokens, block_keys  # noqa: E402
from fastkv.cli import at_least  # noqa: E402
from fastkv.config import KVLayout  # noqa: E402
from fastkv.deploy.cost_model import GPT_OSS_20B_H100, Deployment  # noqa: E402

ROOT = b"hybrid bench root key, 32 bytes."
VOCAB = 50_000
GOAL = 1.5


@dataclasses.dataclass
class Seq:
    rid: int
    tokens: list[int]
    out: int  # tokens to generate in all
    prompt: int
    keys: list = dataclasses.field(default_factory=list)
    values: np.ndarray = dataclasses.field(default_factory=lambda: np.zeros(0, np.int64))
    computed: int = 0
    admitted: int = 0  # tokens at admission: a preempted request comes back with what it generated

    def extend_values(self) -> None:
        """The cache-free KV of every position: a function of the prefix (wrapping int64 sums)."""
        n = len(self.values)
        t = np.asarray(self.tokens[n:], dtype=np.int64)
        pos = np.arange(n, len(self.tokens), dtype=np.int64)
        step = t * 1_000_003 + pos * 7919 + 1
        base = self.values[-1] if n else np.int64(0)
        with np.errstate(over="ignore"):
            self.values = np.concatenate([self.values, base + np.cumsum(step)])

    def extend_keys(self, bs: int) -> None:
        full = len(self.tokens) // bs
        if full > len(self.keys):
            parent = self.keys[-1] if self.keys else ROOT
            chunk = as_tokens(self.tokens[len(self.keys) * bs:full * bs])
            self.keys += block_keys(chunk, bs, parent)


def sample(reads: list[np.ndarray]) -> int:
    """The next token from what each layer kind read (full layers, then sliding layers)."""
    h = 0
    with np.errstate(over="ignore"):
        for r in reads:
            h = (h * 1_000_033 + int(r.sum(dtype=np.int64))) & ((1 << 62) - 1)
    return h % VOCAB


def oracle_reads(seq: Seq, p: int, windows: list[int]) -> list[np.ndarray]:
    return [seq.values[max(0, p - w + 1) if w else 0:p + 1] for w in windows]


def workload(requests: int, prompt: int, output: int, share: int, window: int, seed: int) -> list[Seq]:
    rng = np.random.default_rng(seed)
    prefix_len = min(prompt - 1, 4 * window)  # shared past the window: a hit needs both groups
    prefixes = {}
    seqs = []
    for i in range(requests):
        fam = i // share
        if fam not in prefixes:
            prefixes[fam] = rng.integers(1, VOCAB, prefix_len).tolist()
        toks = prefixes[fam] + rng.integers(1, VOCAB, prompt - prefix_len).tolist()
        seqs.append(Seq(i, toks, output, prompt))
    return seqs


def run(layout: KVLayout, caps: list[int], dep: Deployment, seqs: list[Seq], chunk: int, budget: int) -> dict:
    """One pass of the workload over a cache of ``layout`` (module docstring)."""
    bs = layout.block_size
    cache = GroupedCache(layout, caps)
    store = [np.zeros((c, bs), dtype=np.int64) for c in caps]
    windows = sorted({w for w in dep.windows} or {0})  # the model's layer kinds
    # which group caches each layer kind: its own, or the one full group of an all-full cache
    of_kind = [next((g.index for g in cache.groups if g.group.window == w), 0) for w in windows]
    waiting = deque(dataclasses.replace(s, tokens=list(s.tokens)) for s in seqs)
    running: list[Seq] = []
    outputs: dict[int, list[int]] = {}
    clock, batches, preemptions, mismatches, hit_tokens = 0.0, [], 0, 0, 0
    while waiting or running:
        while waiting:
            s = waiting[0]
            s.extend_keys(bs)
            got = cache.allocate(s.rid, s.keys, len(s.tokens), chunk)
            if got is None:
                break
            waiting.popleft()
            s.computed, s.admitted = got, len(s.tokens)
            hit_tokens += got
            running.append(s)
        if not running:
            sys.exit(f"--device-gb: {layout.describe()} in blocks {caps} cannot hold one request of "
                     f"{len(waiting[0].tokens)} tokens")
        work: list[tuple[Seq, int, int]] = []
        left = budget
        for s in sorted(running, key=lambda s: s.computed < s.admitted):  # decodes first
            if s not in running:
                continue  # preempted below for an older one
            n = min(len(s.tokens) - s.computed, chunk, left)
            if n <= 0:
                continue
            while cache.slots(s.rid, s.computed, n) is None:
                victim = running.pop()  # the newest: recompute it later
                cache.free(victim.rid)
                preemptions += 1
                victim.computed = 0
                waiting.appendleft(victim)
                work = [w for w in work if w[0] is not victim]
                if victim is s:
                    break
            if s in running:
                work.append((s, s.computed, n))
                left -= n
        clock += dep.step_seconds([(start, start + n) for _, start, n in work])
        decodes = 0
        for s, start, n in work:
            tables = cache.tables(s.rid)
            s.extend_values()
            pos = np.arange(start, start + n)
            for g, table in enumerate(tables):
                store[g][table[pos // bs], pos % bs] = s.values[start:start + n]
            s.computed = start + n
            cache.computed(s.rid, s.computed, s.keys)
            if s.computed < len(s.tokens):
                continue
            decodes += start >= s.admitted
            p = s.computed - 1
            reads = []
            for w, g in zip(windows, of_kind, strict=True):
                lo = max(0, p - w + 1) if w else 0
                q = np.arange(lo, p + 1)
                reads.append(store[g][tables[g][q // bs], q % bs])
            tok = sample(reads)
            mismatches += tok != sample(oracle_reads(s, p, windows))
            s.tokens.append(tok)
            s.extend_keys(bs)
            if s.computed == s.admitted:
                cache.set_chunk(s.rid, 1)
            if len(s.tokens) - s.prompt >= s.out:
                cache.free(s.rid)
                running.remove(s)
                outputs[s.rid] = s.tokens[s.prompt:]
        if decodes:
            batches.append(decodes)
        for s in running:  # the bound of a decoding request's sliding tables (check_integrity, cheaply)
            held = cache.held_blocks(s.rid)
            assert all(g.group.max_blocks(bs) is None or s.computed < s.admitted or h <= g.group.max_blocks(bs)
                       for g, h in zip(cache.groups, held, strict=True)), (s.rid, held)
    cache.check_integrity()
    generated = sum(len(o) for o in outputs.values())
    return {"tokens_per_s": generated / clock, "requests_in_flight": float(np.mean(batches)),
            "preemptions": preemptions, "mismatches": mismatches, "outputs": outputs, "gpu_s": clock,
            "hit_tokens": hit_tokens, "blocks": caps}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=at_least(1), default=72)
    p.add_argument("--prompt", type=at_least(1), default=32768, help="prompt tokens")
    p.add_argument("--output", type=at_least(1), default=2048, help="generated tokens per request")
    p.add_argument("--share", type=at_least(1), default=4, help="requests per shared prefix")
    p.add_argument("--device-gb", type=at_least(0.001, float), default=30.0,
                   help="KV device tier per GPU (an H100's 80 GB less 42 GB of bf16 weights and working memory)")
    p.add_argument("--block-size", type=at_least(1), default=16)
    p.add_argument("--chunk", type=at_least(1), default=2048, help="prefill tokens per request and step")
    p.add_argument("--budget", type=at_least(1), default=4096, help="tokens per step")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--smoke", action="store_true", help="tiny sizes, each flag given still counts (tests: "
                   "numbers mean nothing)")
    if "--smoke" in sys.argv[1:]:
        p.set_defaults(requests=6, prompt=600, output=12, device_gb=0.25, chunk=256, budget=512)
    args = p.parse_args()
    dep = GPT_OSS_20B_H100
    shape = dict(num_layers=dep.layers, kv_heads=dep.kv_heads, block_size=args.block_size, head_dim=dep.head_dim)
    hybrid, all_full = KVLayout(**shape, windows=dep.windows), KVLayout(**shape)
    device = int(args.device_gb * 1e9)
    context = args.prompt + args.output
    seqs = workload(args.requests, args.prompt, args.output, args.share, max(dep.windows), args.seed)
    # as many requests prefill at once as chunks fit a step's budget: each reserves its window and chunk
    prefills = max(1, args.budget // args.chunk)
    try:
        caps = {"hybrid": split_device_tier(hybrid, device, context, args.chunk, prefills),
                "all_full": [device // all_full.block_bytes]}
    except ValueError as exc:
        sys.exit(f"--device-gb: {exc}")
    res = {}
    for name, layout in (("hybrid", hybrid), ("all_full", all_full)):
        t0 = time.perf_counter()
        res[name] = run(layout, caps[name], dep, seqs, args.chunk, args.budget)
        res[name]["wall_s"] = time.perf_counter() - t0
    per_req = {"hybrid": dep.kv_bytes_held(context, args.block_size),
               "all_full": dep.kv_bytes_held(context, args.block_size, grouped=False)}
    identical = res["hybrid"]["outputs"] == res["all_full"]["outputs"] and not any(
        r["mismatches"] for r in res.values())
    print(f"{dep.name}: {args.requests} requests of {args.prompt} + {args.output} tokens, "
          f"{args.device_gb:g} GB of device tier, blocks of {args.block_size}")
    print(f"{'cache':>9} {'blocks per group':>18} {'in flight':>9} {'tok/s':>9} {'GPU s':>8} {'preempt':>7} "
          f"{'hit tok':>8} {'KV/request':>11} {'wall s':>7}")
    for name, r in res.items():
        print(f"{name:>9} {'/'.join(map(str, r['blocks'])):>18} {r['requests_in_flight']:9.1f} "
              f"{r['tokens_per_s']:9.0f} {r['gpu_s']:8.2f} {r['preemptions']:7d} {r['hit_tokens']:8d} "
              f"{per_req[name] / 2**20:9.0f} MiB {r['wall_s']:7.1f}")
    speedup = res["hybrid"]["tokens_per_s"] / res["all_full"]["tokens_per_s"]
    print(f"hybrid / all_full tokens/s: {speedup:.2f} (goal >= {GOAL}); outputs identical: {identical}")
    print(json.dumps({"bench": "hybrid",
                      "requests_in_flight": {k: round(r["requests_in_flight"], 2) for k, r in res.items()},
                      "tokens_per_s": {k: round(r["tokens_per_s"], 1) for k, r in res.items()},
                      "kv_bytes_per_request": per_req, "outputs_identical": identical,
                      "speedup": round(speedup, 3)}))
    if not identical:
        sys.exit("outputs differ between the caches or from the cache-free values")


if __name__ == "__main__":
    main()

"""bench_routing.py's shared-prefix workload: its requests share documents across users and
conversations, and a four-engine smoke run reports every engine under every policy."""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "bench_routing.py"


def _module():
    spec = importlib.util.spec_from_file_location("bench_routing", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_shared_workload_shares_documents_across_conversations():
    mod = _module()
    args = argparse.Namespace(docs=6, users=50, rate=10.0)
    reqs, conv = mod.shared(300, args, seed=1)
    assert len(reqs) == len(conv) == 300
    assert [r["arrival_s"] for r in reqs] == sorted(r["arrival_s"] for r in reqs)
    heads = Counter(tuple(r["prompt"][:1024]) for r in reqs)  # every document is >= 1024 tokens
    assert 2 <= len(heads) <= 6  # a few documents ...
    by_head: dict[tuple, set] = {}
    for r, c in zip(reqs, conv, strict=True):
        by_head.setdefault(tuple(r["prompt"][:1024]), set()).add(c)
    assert max(len(cs) for cs in by_head.values()) >= 10  # ... each opening many conversations
    turns = Counter(conv)
    assert max(turns.values()) > 1  # later turns extend their conversation's earlier prompt
    for c in (c for c, k in turns.items() if k > 1):
        first, second = [r["prompt"] for r, cc in zip(reqs, conv, strict=True) if cc == c][:2]
        assert second[:len(first)] == first and len(second) > len(first)


def test_a_four_engine_smoke_run_reports_every_engine(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--workload", "shared", "--engines", "4"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout.strip().splitlines()[-1])
    assert doc["bench"] == "routing" and doc["requests"] == 24
    for policy in ("round_robin", "session", "indexer"):
        assert set(doc["per_engine"][policy]) == {"e0", "e1", "e2", "e3"}
        assert sum(doc["per_engine"][policy].values()) == 24
        assert doc["ttft_p50_s"][policy] > 0 and doc["tokens_per_s"][policy] > 0


def test_the_work_score_weighs_the_cached_prefix_per_tier_against_the_backlog():
    from fastkv.routing.indexer import Prefix

    mod = _module()
    args = argparse.Namespace(score="work", host_weight=0.8, load_tokens=256.0, load_weight=0.05)

    class Engine:
        def __init__(self, name, pending=(), unfinished=0):
            self.name, self.pending, self.unfinished = name, dict(enumerate(pending)), unfinished

    class Idx:
        def __init__(self, prefixes):
            self.prefixes = prefixes

        def longest_prefix(self, hashes):
            return self.prefixes

    hashes, n = [b"k"] * 100, 1600 + 10  # 100 full blocks of 16, and a partial one
    held = {"e0": Prefix(0, 0, 0, 0), "e1": Prefix(60, 60, 0, 90)}  # e1: 60 blocks on device, 30 more on host
    idle = [Engine("e0"), Engine("e1")]
    pick, work = mod.choose(Idx(held), idle, hashes, n, args)
    assert pick == 1 and work == n - 16 * (60 + 0.8 * 30)
    # a backlog worth more than the saving sends the request where nothing is cached
    busy = [Engine("e0"), Engine("e1", pending=[800.0, 600.0], unfinished=2)]
    pick, work = mod.choose(Idx(held), busy, hashes, n, args)
    assert pick == 0 and work == n
    # a host-cached block is worth less than a device-cached one
    tiers = {"e0": Prefix(40, 40, 0, 40), "e1": Prefix(0, 45, 0, 45)}
    assert mod.choose(Idx(tiers), idle, hashes, n, args)[0] == 0

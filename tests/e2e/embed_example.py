"""Embedding fastkv in a deployment: the README's example, run as written by test_embed_example.py.

A toy model worker written only against the documented API (docs/WORKER_API.md): it writes
each new token's K/V at the plan's slots, checks that the K/V of the positions before it are
what it wrote (a block lost or misplaced by a preemption fails the run), and samples from the
K/V it reads. Usage: ``python embed_example.py [--tp N]``: serves the same requests twice, with
a device tier big enough for all of them and with one so small that requests are preempted
(offloaded to the host tier), and exits 0 when the outputs are identical and every token
was streamed step by step.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import uuid
from pathlib import Path

import numpy as np

from fastkv.config import KVLayout
from fastkv.engine import Engine
from fastkv.engine.worker_api import WorkerPort
from fastkv.launch import launch
from fastkv.run import RunSpec
from fastkv.transfer.tiers import DeviceTier

VOCAB = 1000
# "module:function" of the worker below, however this file was started
WORKER = f"{__spec__.name if __spec__ else Path(__file__).stem}:worker_main"


# -- the model worker: one process per tensor-parallel rank --------------------------------
def toy_step(plan, k, v, block_size: int, history: dict[str, list[int]]) -> tuple[dict[str, int], str]:
    """K = token + 1 and V = position + 1 at every slot of layer 0; the next token is a hash of
    the K/V read back and of the request's sampling parameters."""
    sampled, errors = {}, []
    for seq in plan.seqs:
        hist = history.setdefault(seq.request_id, [])
        del hist[seq.start_pos:]  # recomputed after a preemption: the same tokens again
        if len(hist) < seq.start_pos:  # a prefix hit: another request's K/V, taken as read (the output checks it)
            pos = np.arange(len(hist), seq.start_pos)
            hist += (k[0][seq.block_table[pos // block_size], 0, pos % block_size, 0].astype(np.int64) - 1).tolist()
        hist += [int(t) for t in seq.token_ids]
        for pos in range(seq.start_pos, len(hist)):
            blk, off = seq.block_table[pos // block_size], pos % block_size
            k[0][blk, :, off, :] = hist[pos] + 1
            v[0][blk, :, off, :] = pos + 1
        pos = np.arange(len(hist))
        blocks, offs = seq.block_table[pos // block_size], pos % block_size
        keys, vals = k[0][blocks, 0, offs, 0].astype(np.int64), v[0][blocks, 0, offs, 0].astype(np.int64)
        if not (np.array_equal(keys, np.array(hist) + 1) and np.array_equal(vals, pos + 1)):
            errors.append(f"{seq.request_id}: K/V of positions < {seq.start_pos} lost")
        if seq.sample:
            sampled[seq.request_id] = toy_sample(keys.tolist(), seq.sampling.seed or 0, seq.sampling.temperature)
    return sampled, "; ".join(errors)


def toy_sample(keys: list[int], seed: int, temperature: float) -> int:
    mix = sum((p + 1) * k for p, k in enumerate(keys)) * 2654435761 + seed * 97 + int(temperature * 100)
    return mix % VOCAB


def reference(prompt: list[int], max_new_tokens: int, seed: int, temperature: float) -> list[int]:
    """What the toy model samples when its K/V is intact and the sampling parameters arrive."""
    tokens = list(prompt)
    for _ in range(max_new_tokens):
        tokens.append(toy_sample([t + 1 for t in tokens], seed, temperature))
    return tokens[len(prompt):]


def worker_main(spec_json: str, rank: int, layerwise: bool = True) -> int:
    """``layerwise``: the toy's one layer waits for its K/V landing (``port.wait_layer``) instead
    of ``plans()`` waiting for whole copies (docs/WORKER_API.md, layer-wise loading)."""
    spec = RunSpec.from_json(spec_json)
    port = WorkerPort(spec, rank, layerwise=layerwise)
    tier = DeviceTier.attach(spec.tier_prefix, rank, spec.layout, spec.num_device_blocks)
    history: dict[str, list[int]] = {}  # per-request state: dropped when the engine releases it
    port.ready()
    try:
        for plan in port.plans():
            if layerwise:
                port.wait_layer(plan, 0)  # before the layer writes or reads K/V
            sampled, error = toy_step(plan, tier.k_arrays, tier.v_arrays, spec.layout.block_size, history)
            port.answer(plan, sampled, error)
            for request_id in plan.release:
                history.pop(request_id, None)
    finally:
        tier.close()
        port.close()
    print(f"toy worker {rank}: per-request state left at exit: {sorted(history)}", flush=True)
    return 0


# -- the serving side -----------------------------------------------------------------------
def serve(spec: RunSpec, prompts: list[list[int]], max_new_tokens: int, layerwise: bool = True) -> dict:
    streamed: dict[str, list[list[int]]] = {}  # request id -> the tokens of each step that had some
    finished = {}
    with launch(spec) as run:  # namespace, channels, tiers, transfer processes; all gone after the block
        for rank in range(spec.tp_size):
            run.start("worker", rank, WORKER, (spec.to_json(), rank, layerwise))
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready()
            for i, prompt in enumerate(prompts):
                engine.add_request(prompt, max_new_tokens, request_id=f"req-{i}", preemption="offload",
                                   sampling={"seed": i, "temperature": 0.7})
            while engine.has_work():
                update = engine.step_stream()
                for request_id, tokens in update.tokens.items():
                    streamed.setdefault(request_id, []).append(tokens)
                for result in update.finished:
                    finished[result.id] = result
        finally:
            engine.close()
    return {"outputs": {r.id: r.output for r in finished.values()},
            "finish": {r.id: r.finish for r in finished.values()},
            "preemptions": sum(r.preemptions for r in finished.values()),
            "streamed": streamed}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    args = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, int(n)).tolist() for n in rng.integers(6, 14, 6)]
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=4, head_dim=8, dtype="float32", tp_size=args.tp)
    report = {}
    with tempfile.TemporaryDirectory() as out:
        for name, device_blocks in (("roomy", 64), ("tight", 12)):
            spec = RunSpec(f"embed{uuid.uuid4().hex[:8]}", layout, device_blocks, 64, out_dir=f"{out}/{name}",
                           heartbeat_s=0.2, dead_after_s=5.0)
            report[name] = serve(spec, prompts, max_new_tokens=12)
            # every release reached every rank, the last ones too (sent when the engine idles or closes)
            logs = [Path(spec.out_dir, "logs", f"worker{r}.log").read_text() for r in range(args.tp)]
            report[name]["released"] = all(log.rstrip().endswith("left at exit: []") for log in logs)
    roomy, tight = report["roomy"], report["tight"]
    checks = {
        "preempted": tight["preemptions"] > 0 and roomy["preemptions"] == 0,
        "identical": tight["outputs"] == roomy["outputs"] and len(roomy["outputs"]) == len(prompts),
        # the K/V read back intact, and each request's own sampling parameters reached the workers
        "reference": all(roomy["outputs"][f"req-{i}"] == reference(p, 12, i, 0.7) for i, p in enumerate(prompts)),
        "all_length": set(tight["finish"].values()) == {"length"},
        "released": roomy["released"] and tight["released"],
        # every token streamed, one per step (a prompt's last chunk samples the first)
        "streamed": all([t for step in run["streamed"][rid] for t in step] == out and
                        all(len(step) == 1 for step in run["streamed"][rid])
                        for run in report.values() for rid, out in run["outputs"].items()),
    }
    print(json.dumps({"tp": args.tp, "preemptions": tight["preemptions"], "checks": checks}))
    return 0 if all(checks.values()) else 1


if __name__ == "__main__":
    sys.exit(main())

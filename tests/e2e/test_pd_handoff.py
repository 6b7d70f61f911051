"""Prefill -> decode handoff through one shared store (``--role``): a prefill engine computes
each prompt and exports its KV; a decode engine takes the requests, loads their KV and decodes.
Its outputs equal a single engine's (the synthetic runner's next token hashes the KV it reads,
so a wrong block changes them), with no prompt token recomputed, and under pressure it refuses
a request with a reason rather than preempt its running ones for it."""
from __future__ import annotations

from tests.e2e.test_engine_synthetic import VOCAB, check_outputs, spec, workload
from tests.e2e.test_storage_pool import Run


def run_role(tmp_path, name, url, wl, **kw):
    s = spec(1, tmp_path / name, num_device_blocks=24, num_host_blocks=24, storage_url=url,
             runner_options={"verify": "all", "vocab": VOCAB}, scheduler={"max_num_batched_tokens": 48}, **kw)
    with Run(s, wl) as run:
        assert run.wait(120) == 0, "engine failed: a KV mismatch or a worker error (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    return results, summary


def test_decode_engine_serves_the_prefill_engines_prompts_token_identically(tmp_path):
    wl = workload(10, 8, [None])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    _, pre = run_role(tmp_path, "pre", url, wl, role="prefill")
    assert pre["handoff"]["requests"] == len(wl) and pre["handoff"]["failed"] == 0, pre["handoff"]
    results, dec = run_role(tmp_path, "dec", url, wl, role="decode", handoff=str(tmp_path / "pre" / "handoff.jsonl"))
    check_outputs(results, wl)  # the single-engine reference outputs
    h = dec["handoff"]
    print("prefill", pre["handoff"], "decode", h)
    assert h["requests"] == len(wl) and h["recomputed_prompt_tokens"] == 0 and h["bytes"] > 0, h
    assert all(r["recomputed_tokens"] == 0 for r in results.values())
    assert dec["verified"]["kv_mismatches"] == 0
    # 24 device blocks for 10 requests: some had to wait, each refusal named with its reason
    assert h["refused"] == len(h["refusals"]) > 0, h
    assert sum(dec["preemptions"].values()) == 0, dec["preemptions"]  # it refused instead
    assert all("NO_ROOM" in why or "TOO_MANY_SEQS" in why for why in h["refusals"].values()), h

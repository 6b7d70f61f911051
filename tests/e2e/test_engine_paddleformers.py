"""PaddleFormers' own models served through fastkv, one run per model family (Llama, ERNIE 4.5,
and the sliding-window hybrids Gemma 3 and gpt-oss): engine, workers, transfer processes.

The oracle is the library itself: greedy decoding by the model's own no-cache forward (each
prompt alone, the argmax of the last position's logits over the whole sequence, recomputed from
scratch for every new token), on the same seeded weights, computed here. The library's
``generate()`` agrees with it except for Gemma 3 once a decode is past the window (its sliding
cache's mask is cut to the wrong columns: ``paddleformers/gemma3.py``); the first tests show
where the two agree and where they part. The hybrids' windows (6 tokens, not a whole number of
4-token blocks) are shorter than every prompt and than the 8-token prefix the odd prompts share,
so windows slide in prefill, in decode and across prefix hits. Every
request's output must equal it token for token, under memory pressure in every preemption
mode, after a restart on a warm store, through the prefill -> decode pair, and at tp 2.
One flipped byte in one swapped-in block changes the output: the check has teeth.
"""
from __future__ import annotations

from functools import cache

import numpy as np
import pytest

from tests.optional import require_paddleformers

require_paddleformers()  # a skip without the models extra, a failure under CI

import paddle  # noqa: E402

from fastkv.cache.plan import CopyKind  # noqa: E402
from fastkv.config import KVLayout  # noqa: E402
from fastkv.engine.runners import runner_class  # noqa: E402
from fastkv.engine.runners.paddleformers_config import settings  # noqa: E402
from fastkv.run import RunSpec  # noqa: E402
from tests.e2e.launch import Run, new_run_id  # noqa: E402

FAMILIES = ("llama", "ernie4_5", "gemma3", "gpt_oss")
SEED = 3
SEEDS = {"gpt_oss": 4}  # seed 3's gpt-oss has a top-2 margin below MIN_MARGIN
WINDOW = 6
SLIDING, FULL = "sliding_attention", "full_attention"
# per family: its config settings beyond the shared ones (the hybrids: 4 layers, their layer kinds)
CONFIG = {
    "llama": {},
    "ernie4_5": {},
    "gemma3": {"sliding_window": WINDOW, "layer_types": [SLIDING] * 3 + [FULL], "query_pre_attn_scalar": 16},
    "gpt_oss": {"sliding_window": WINDOW, "layer_types": [SLIDING, FULL] * 2},
}
MAX_NEW = 10
SYSTEM = [7, 200, 41, 99, 5, 211, 18, 64]  # a shared system prompt: prefix-cache hits across requests
PROMPTS = {f"q{i}": (SYSTEM if i % 2 else []) + [(i * 37 + j * 13) % 250 + 1 for j in range(6 + 2 * i)]
           for i in range(8)}
# The oracle's top-2 logit margin must dwarf float32 noise (~1e-6 here): a batch or chunk shape
# can then not flip a token, and a mismatch is a wrong KV, never rounding.
MIN_MARGIN = 1e-4


def options(family: str) -> dict:
    return {"config": {"vocab_size": 256, "intermediate_size": 128, **CONFIG[family]},
            "seed": SEEDS.get(family, SEED)}


def layout(family: str, tp: int) -> KVLayout:
    """Every family's tiny model: 2 layers (the hybrids 4), 4 query heads, 2 KV heads, head_dim 16."""
    layers = len(CONFIG[family].get("layer_types", (FULL, FULL)))
    return KVLayout(num_layers=layers, kv_heads=2 // tp, block_size=4, head_dim=16, dtype="float32", tp_size=tp)


@cache
def model(family: str):
    """The whole model (tp 1) of ``family`` on the seeded weights the runners load."""
    opts = options(family)
    return runner_class(f"paddleformers:{family}").build_model(settings(family, layout(family, 1), opts), opts["seed"])


@cache
def oracle(family: str) -> tuple[dict[str, list[int]], float]:
    """Greedy decoding of each prompt alone by the model's no-cache forward: every new token is
    the argmax of the last position of a full forward over prompt + tokens so far (numpy's
    argmax takes the lowest id on a tie, as generate()'s paddle.argmax does). And the least
    top-2 margin of the logits behind those tokens."""
    m = model(family)
    out, margin = {}, np.inf
    with paddle.no_grad():
        for rid, prompt in PROMPTS.items():
            seq = list(prompt)
            for _ in range(MAX_NEW):
                logits = m(paddle.to_tensor([seq]), return_dict=True).logits[0, -1].numpy()
                seq.append(int(np.argmax(logits)))
                top2 = np.sort(logits)[-2:]
                margin = min(margin, float(top2[1] - top2[0]))
            out[rid] = seq[len(prompt):]
    return out, margin


def generated(family: str) -> dict[str, list[int]]:
    """Each prompt alone through the library's generate() (greedy, its own DynamicCache)."""
    m = model(family)
    with paddle.no_grad():
        return {rid: m.generate(paddle.to_tensor([p]), max_new_tokens=MAX_NEW,
                                decode_strategy="greedy_search")[0].numpy()[0].tolist() for rid, p in PROMPTS.items()}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "gemma3"])
def test_the_oracle_no_cache_forward_equals_generate(family):
    """The two ways the library decodes agree for these families, with margins that a batch or
    chunk shape cannot flip."""
    want, margin = oracle(family)
    assert generated(family) == want
    assert margin > MIN_MARGIN, f"the oracle's logit margin {margin:.2e} is too thin for a token check: pick a seed"
    assert len({tuple(v) for v in want.values()}) == len(PROMPTS)  # no degenerate model: outputs differ


def test_gemma3_generate_equals_the_forward_only_until_a_decode_passes_the_window():
    """Gemma 3's generate() computes a new token right while the query's position is inside the
    window (the prefill's last position, and decodes at positions < WINDOW: keys and mask
    complete), and parts from the forward once a decode is past it: the oracle is the forward."""
    want, margin = oracle("gemma3")
    got = generated("gemma3")
    assert margin > MIN_MARGIN, f"the oracle's logit margin {margin:.2e} is too thin for a token check: pick a seed"
    assert len({tuple(v) for v in want.values()}) == len(PROMPTS)
    parted = 0
    for rid, prompt in PROMPTS.items():
        # new token k (0-based) comes from the query at position len(prompt) - 1 + k; k = 0 is the prefill's
        inside = max(1, WINDOW - len(prompt) + 1)
        assert got[rid][:inside] == want[rid][:inside], rid
        parted += got[rid] != want[rid]
    assert parted >= len(PROMPTS) // 2, f"generate() parted from the forward on only {parted} prompts: {got}"


def test_gpt_oss_forward_is_causal_with_one_expert_only():
    """Why gpt-oss runs with one expert: with several, the library's inference MoE mixes tokens
    (``paddleformers/gpt_oss.py``), so a position's logits change with the tokens after it."""
    s = settings("gpt_oss", layout("gpt_oss", 1), options("gpt_oss"))
    prompt = paddle.to_tensor([PROMPTS["q1"]])
    moved = {}
    for experts in (1, 4):
        m = runner_class("paddleformers:gpt_oss").build_model({**s, "num_local_experts": experts,
                                                                "num_experts_per_tok": min(experts, 2)},
                                                              options("gpt_oss")["seed"])
        with paddle.no_grad():
            whole, head = (m(prompt[:, :n], return_dict=True).logits[0].numpy() for n in (prompt.shape[1], 10))
        moved[experts] = float(np.abs(whole[:10] - head).max())
    assert moved[1] < 1e-5 and moved[4] > 1e-2, moved


def workload() -> list[dict]:
    return [{"id": rid, "arrival_s": 0, "prompt": p, "max_new_tokens": MAX_NEW, "preemption": None}
            for rid, p in PROMPTS.items()]


def spec(family: str, tp: int, out_dir, mode: str, storage_url: str = "", **kw) -> RunSpec:
    """20 device blocks of 4 tokens for 8 requests of up to 32: preemption under pressure.
    Storage mode gets a small host tier, so host copies are evicted and resumes LOAD; recompute
    mode none, so a preempted request recomputes whatever the timing of write-through copies
    (with a host tier, its KV may still be there to hit)."""
    kw.setdefault("num_device_blocks", 20)
    kw.setdefault("num_host_blocks", {"storage": 8, "recompute": 0}.get(mode, 48))
    return RunSpec(new_run_id(), layout(family, tp), storage_url=storage_url, runner=f"paddleformers:{family}",
                   runner_options=options(family), scheduler={"preemption": mode, "max_num_batched_tokens": 48},
                   heartbeat_s=0.2, out_dir=str(out_dir), slot_size=256, nslots=256, **kw)


def serve(s: RunSpec, transfer: str | None = None) -> tuple[dict, dict]:
    with Run(s, workload(), **({"transfer": transfer} if transfer else {})) as run:
        assert run.wait(180) == 0, "engine failed (see its stderr above)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), f"process exit codes {codes}"
    return results, summary


def mismatches(family: str, results: dict) -> dict[str, tuple[list[int], list[int]]]:
    """Requests whose output is not the oracle's: id -> (fastkv's, the library's)."""
    want, margin = oracle(family)
    assert margin > MIN_MARGIN, f"the oracle's logit margin {margin:.2e} is too thin for a token check: pick a seed"
    assert sorted(results) == sorted(want)
    return {rid: (row["output"], want[rid]) for rid, row in results.items()
            if row["finish"] != "length" or row["output"] != want[rid]}


def check_preempted(summary: dict, mode: str) -> None:
    pre = summary["preemptions"]
    assert summary["requests"] == len(PROMPTS) and summary["generated_tokens"] == len(PROMPTS) * MAX_NEW
    if mode == "auto":
        assert sum(pre.values()) > 0, f"no preemption under pressure: {summary}"
    else:
        assert pre[mode] > 0, f"no {mode} preemption under pressure: {summary}"
    if mode == "recompute":
        assert summary["recomputed_tokens"] > 0, summary
    if mode == "offload":
        assert summary["recomputed_tokens"] == 0 and summary["copy_tasks"].get("swap_in", 0) > 0, summary
    if mode == "storage":
        assert summary["copy_tasks"].get("store", 0) > 0, summary
        assert summary["storage_errors"] == 0 and summary["recomputed_because_storage"] == 0, summary


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("tp", "mode"), [(1, "recompute"), (1, "offload"), (1, "storage"), (1, "auto"),
                                          (2, "offload"), (2, "storage")])
def test_every_request_equals_the_oracle_under_preemption(family, tp, mode, tmp_path):
    """At tp 2 each rank holds one of the two KV heads, its two query heads and half of every
    projection; the partial sums of o_proj and down_proj meet in the workers' collective."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64M" if mode == "storage" else ""
    results, summary = serve(spec(family, tp, tmp_path / "out", mode, url))
    assert not mismatches(family, results)
    check_preempted(summary, mode)


HYBRIDS = ("gemma3", "gpt_oss")


def hybrid_layout(family: str) -> KVLayout:
    """``layout``'s, with the model's windows: one device pool and block table per KV cache group."""
    windows = tuple(WINDOW if kind == SLIDING else 0 for kind in CONFIG[family]["layer_types"])
    return KVLayout(num_layers=len(windows), kv_heads=2, block_size=4, head_dim=16, dtype="float32", windows=windows)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["recompute", "offload"])
@pytest.mark.parametrize("family", HYBRIDS)
def test_a_hybrid_with_per_group_tables_equals_the_oracle_under_preemption(family, mode, tmp_path):
    """The sliding layers' cache holds and reads only its window's tail (16 blocks for every
    request's sliding layers, 12 for the full ones): outputs are the no-cache forward's, with
    windows shorter than every prompt, preemptions and prefix hits, and a sliding group never
    holds more than ceil(WINDOW / block_size) + 1 blocks of a request between its steps. Under
    offload each group copies out what it holds (a sliding group its window's tail) to a host
    segment of its own, and the restore brings exactly that back."""
    lay = hybrid_layout(family)
    assert [g.window for g in lay.groups] == [WINDOW, 0]
    s = RunSpec(new_run_id(), lay, num_device_blocks=16, num_host_blocks=64 if mode == "offload" else 0,
                group_blocks=(16, 12), runner=f"paddleformers:{family}", runner_options=options(family),
                scheduler={"preemption": mode, "max_num_batched_tokens": 48}, heartbeat_s=0.2,
                out_dir=str(tmp_path / "out"), slot_size=256, nslots=256)
    results, summary = serve(s)
    assert not mismatches(family, results)
    check_preempted(summary, mode)
    bound = -(-WINDOW // 4) + 1
    sliding, full = summary["kv_groups"]
    assert 0 < sliding["max_held_per_request"] <= bound, summary["kv_groups"]
    assert full["max_held_per_request"] > bound and sliding["hit_blocks"] > 0, summary["kv_groups"]
    if mode == "offload":
        assert 0 < sliding["max_offloaded_per_request"] <= bound < full["max_offloaded_per_request"], \
            summary["kv_groups"]


def test_a_hybrid_layout_whose_windows_are_not_the_models_is_refused():
    lay = KVLayout(num_layers=4, kv_heads=2, block_size=4, head_dim=16, dtype="float32", windows=(4, 0) * 2)
    blocks = lay.layer_blocks((8, 8), 0)
    k = [np.zeros(lay.device_shape(n), np.float32) for n in blocks]
    with pytest.raises(ValueError, match=r"KVLayout.windows \[4, 0, 4, 0\] are not the model's"):
        runner_class("paddleformers:gpt_oss")(lay, 0, 1, k, [a.copy() for a in k], **options("gpt_oss"))


def corrupting_transfer_main(spec_json: str, rank: int) -> int:
    """The transfer process, but the first block it swaps in from the host has one byte flipped
    there just before the copy: the top exponent bit of a key of its first slot whose magnitude
    is in [1, 2), which makes it NaN. A merely scaled value may or may not move an argmax
    (a probe: a x2^128 key or value changed 6 to 8 of 8 requests' outputs); a NaN poisons
    every score it meets, so a request that reads the block cannot get the oracle's tokens."""
    from fastkv.transfer import process
    from fastkv.transfer.executor import TaskExecutor
    from fastkv.transfer.protocol import task_plan

    swap, layered = TaskExecutor._swap, TaskExecutor._layered
    flipped = []

    def flip_then_swap(self, plan):
        flip(self, plan)
        return swap(self, plan)

    def flip_then_layered(self, msg, progress, early):  # a SWAP_IN copied layer by layer (--layerwise-load)
        flip(self, task_plan(msg))
        return layered(self, msg, progress, early)

    def flip(self, plan):
        if plan.kind is CopyKind.SWAP_IN and not flipped:
            src = int(plan.src[0])
            keys = self.host.array[src][:, 0, :, 0, :]  # [layers, heads, head_dim]: K of slot 0
            hits = np.argwhere((np.abs(keys) >= 1) & (np.abs(keys) < 2))
            if len(hits):
                layer, head, d = hits[0]
                keys[layer, head, d : d + 1].view(np.uint8)[3] ^= 0x40  # little endian: byte 3 = sign, exponent
                flipped.append(src)
                print(f"corrupting transfer{rank}: flipped a byte of host block {src} before its swap-in", flush=True)

    TaskExecutor._swap, TaskExecutor._layered = flip_then_swap, flip_then_layered
    return process.main(spec_json, rank)


@pytest.mark.slow
@pytest.mark.parametrize("checksums", [False, True])
def test_one_flipped_byte_in_a_swapped_in_block_changes_the_output(checksums, tmp_path):
    """Without host checksums the wrong value reaches attention and some request's tokens are no
    longer the oracle's: it sees one wrong block. With them the swap-in is refused and
    recomputed, and every output is right again."""
    s = spec("llama", 1, tmp_path / "out", "offload", host_checksums=checksums)
    results, summary = serve(s, transfer="tests.e2e.test_engine_paddleformers:corrupting_transfer_main")
    assert summary["copy_tasks"].get("swap_in", 0) > 0, summary
    bad = mismatches("llama", results)
    if checksums:
        assert not bad and summary["host_checksum_mismatches"] > 0, (bad, summary)
    else:
        assert bad, "a flipped byte in a swapped-in block went unnoticed by the oracle"
        assert summary["host_checksum_mismatches"] == 0


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_a_restart_on_a_warm_lmdb_store_serves_the_oracle_tokens(family, tmp_path):
    """Run A writes every block through to LMDB (a host tier that holds them all, so what is
    stored does not depend on how fast the store keeps up); run B, new processes and empty
    tiers on A's store, loads the prompts' KV from it instead of computing them."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    a_results, _ = serve(spec(family, 1, tmp_path / "a", "offload", url, num_host_blocks=96))
    assert not mismatches(family, a_results)
    b_results, b = serve(spec(family, 1, tmp_path / "b", "offload", url, num_host_blocks=16))
    assert not mismatches(family, b_results)
    assert b["hit_ratio"]["storage"] > 0 and b["copy_tasks"].get("load", 0) > 0, b
    assert b["storage_lookup"]["keys_found"] > 0 and b["corrupt_values"] == 0, b["storage_lookup"]


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_then_decode_serves_the_oracle_tokens(family, tmp_path):
    """A prefill engine computes each prompt and exports its KV to the shared store; a decode
    engine takes every request from its handoff file, loads that KV and decodes: no prompt
    token recomputed, every output the oracle's."""
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    _, pre = serve(spec(family, 1, tmp_path / "pre", "offload", url, num_device_blocks=24, num_host_blocks=24,
                        role="prefill"))
    results, dec = serve(spec(family, 1, tmp_path / "dec", "offload", url, num_device_blocks=24,
                              num_host_blocks=24, role="decode", handoff=str(tmp_path / "pre" / "handoff.jsonl")))
    assert not mismatches(family, results)
    assert pre["handoff"]["requests"] == len(PROMPTS) and pre["handoff"]["failed"] == 0, pre["handoff"]
    h = dec["handoff"]
    assert h["requests"] == len(PROMPTS) and h["recomputed_prompt_tokens"] == 0 and h["bytes"] > 0, h
    assert all(row["recomputed_tokens"] == 0 for row in results.values())

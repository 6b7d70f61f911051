"""The tiny decoder: exact against a dense numpy reference, and invariant to everything a scheduler varies."""
from __future__ import annotations

import math
import os

import numpy as np
import paddle
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastkv.config import KVLayout
from fastkv.engine.runners.kv_quant import QUANTUM, fake_quantize, quantize
from fastkv.engine.runners.tiny_decoder import (
    ACT_BITS,
    CLIP,
    EPS,
    P_BITS,
    TinyConfig,
    TinyDecoderRunner,
    full_weights,
    rope_tables,
)
from fastkv.sched.output import SeqWork, StepPlan
from tests.runner_driver import drive, solo

# These properties run whole schedules, so they get a fixed budget (4x in CI), not the profile's.
SCALE = 4 if os.environ.get("CI") else 1
# Small enough that a hypothesis example (dozens of steps) takes well under a second.
CFG = TinyConfig(vocab=512, hidden=64, intermediate=128, max_positions=256, seed=3)
LAYOUT = KVLayout(num_layers=2, kv_heads=2, block_size=4, head_dim=16, dtype="float32")


def caches(layout=LAYOUT, blocks=96, fill=0.0):
    k = [np.full(layout.device_shape(blocks), fill, layout.numpy_dtype) for _ in range(layout.num_layers)]
    v = [np.full(layout.device_shape(blocks), fill, layout.numpy_dtype) for _ in range(layout.num_layers)]
    return k, v


def make_runner(layout=LAYOUT, blocks=96, fill=0.0, cfg=CFG, as_paddle=True):
    k, v = caches(layout, blocks, fill)
    if as_paddle:  # the realistic path: shared buffers exposed to Paddle zero-copy
        kt = [paddle.utils.dlpack.from_dlpack(a.__dlpack__()) for a in k]
        vt = [paddle.utils.dlpack.from_dlpack(a.__dlpack__()) for a in v]
        return TinyDecoderRunner(layout, 0, 1, kt, vt, config=cfg), k, v
    return TinyDecoderRunner(layout, 0, 1, k, v, config=cfg), k, v


# -- a dense numpy reference: whole sequence recomputed every token, no paging -----------
def _g(x, bits=ACT_BITS):
    s = float(2**bits)
    return np.clip(np.round(x * s) / s, -CLIP, CLIP)


def _norm(x, gain):
    return _g(x / np.sqrt((x * x).sum(-1, keepdims=True) / x.shape[-1] + EPS) * gain)


def reference(prompt, max_new, layout=LAYOUT, cfg=CFG):
    """Greedy tokens and the final K/V [layers][kv_heads, n, D], from first principles in numpy."""
    Hkv, D = layout.kv_heads, layout.head_dim
    Q = cfg.q_heads(Hkv)
    w = full_weights(cfg, layout.num_layers, Hkv, D)
    cos, sin = rope_tables(cfg, D)

    def rope(x, pos):  # x [n, heads, D]
        c, s = cos[pos][:, None], sin[pos][:, None]
        x1, x2 = x[..., : D // 2], x[..., D // 2 :]
        return _g(np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], -1))

    tokens, out = list(prompt), []
    for _ in range(max_new):
        n = len(tokens)
        pos = np.arange(n)
        x = w["embed"][tokens]
        ks, vs = [], []
        for i in range(layout.num_layers):
            h = _norm(x, w[f"{i}.ln1"])
            q = rope(_g(h @ w[f"{i}.wq"]).reshape(n, Q, D), pos)
            k = rope(_g(h @ w[f"{i}.wk"]).reshape(n, Hkv, D), pos)
            v = _g(h @ w[f"{i}.wv"]).reshape(n, Hkv, D)
            if layout.quant:  # what the cache gives back: rounded once, as written
                min_scale = 2.0**-ACT_BITS / QUANTUM[layout.quant]
                k, v = fake_quantize(k, layout.quant, min_scale), fake_quantize(v, layout.quant, min_scale)
            ks.append(k.transpose(1, 0, 2))
            vs.append(v.transpose(1, 0, 2))
            o = np.empty((n, Q, D))
            for head in range(Q):
                kv = head // (Q // Hkv)
                s = q[:, head] @ k[:, kv].T / math.sqrt(D)
                s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
                p = _g(np.exp(s - s.max(-1, keepdims=True)), P_BITS)
                o[:, head] = _g(p @ v[:, kv] / p.sum(-1, keepdims=True))
            x = _g(x + _g(o.reshape(n, Q * D) @ w[f"{i}.wo"]))
            h = _norm(x, w[f"{i}.ln2"])
            gate, up = _g(h @ w[f"{i}.wg"]), _g(h @ w[f"{i}.wu"])
            x = _g(x + _g(_g(gate * _g(1 / (1 + np.exp(-gate)), P_BITS) * up) @ w[f"{i}.wd"]))
        logits = _norm(x[-1:], w["norm"]) @ w["lm_head"]
        tokens.append(int(np.argmax(logits[0])))
        out.append(tokens[-1])
    return out, ks, vs


def seq_kv(layout, views, table, n):
    """[kv_heads, n, D] of one sequence gathered from per-layer cache views."""
    bs = layout.block_size
    blocks = views[np.asarray(table[: -(-n // bs)])]  # [nb, H, bs, D]
    return blocks.transpose(1, 0, 2, 3).reshape(layout.kv_heads, -1, layout.head_dim)[:, :n]


# -- exactness ------------------------------------------------------------------------
def test_matches_dense_reference_tokens_and_kv_bits():
    prompt = [5, 77, 300, 12, 9, 401, 250]
    want, ks, vs = reference(prompt, 6)
    runner, k, v = make_runner()
    got = solo(runner, prompt, 6)
    assert got == want
    n = len(prompt) + 5  # the last sampled token was never fed
    table = np.arange(-(-(len(prompt) + 6) // LAYOUT.block_size))
    for layer in range(LAYOUT.num_layers):
        np.testing.assert_array_equal(seq_kv(LAYOUT, k[layer], table, n), ks[layer][:, :n].astype(np.float32))
        np.testing.assert_array_equal(seq_kv(LAYOUT, v[layer], table, n), vs[layer][:, :n].astype(np.float32))


def quant_layout(kind, tp=1):
    return KVLayout.of(kind, num_layers=2, kv_heads=2 // tp, block_size=4, head_dim=16, tp_size=tp)


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_quantized_kv_matches_the_reference_that_rounds_the_same(kind):
    """Tokens equal the cache-free model's with K and V rounded as written, and each cache row
    is the quantized row of the reference's K and V, scale included."""
    layout = quant_layout(kind)
    prompt = [5, 77, 300, 12, 9, 401, 250]
    want, ks, vs = reference(prompt, 6, layout)
    runner, k, v = make_runner(layout, fill=0xFF)  # unwritten rows are NaN codes and NaN scales
    assert solo(runner, prompt, 6) == want
    n = len(prompt) + 5
    table = np.arange(-(-(len(prompt) + 6) // layout.block_size))
    for layer in range(layout.num_layers):
        for got, ref in ((k[layer], ks[layer]), (v[layer], vs[layer])):
            rows = got[table].transpose(1, 0, 2, 3).reshape(layout.kv_heads, -1, layout.row_elems)[:, :n]
            np.testing.assert_array_equal(rows, quantize(ref[:, :n], kind, runner.min_scale))


def test_quantization_changes_what_attention_reads():
    """The oracle is sensitive to the rounding: it reaches the next layer's K, and fp8's reaches tokens."""
    prompts = [[t, t + 1, t + 2, 3 * t % 500] for t in range(0, 400, 40)]
    plain = [reference(p, 6) for p in prompts]
    for kind in ("fp8_e4m3", "int8"):
        quant = [reference(p, 6, quant_layout(kind)) for p in prompts]
        assert all(not np.array_equal(a[1][-1], b[1][-1]) for a, b in zip(plain, quant, strict=True)), kind
    fp8 = [reference(p, 6, quant_layout("fp8_e4m3"))[0] for p in prompts]
    assert fp8 != [a[0] for a in plain]


@settings(max_examples=8 * SCALE)
@given(prompts=st.lists(st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=14), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1),
       max_chunk=st.integers(1, 9), kind=st.sampled_from(["fp8_e4m3", "int8"]))
def test_quantized_kv_is_invariant_to_chunking_batching_and_recompute(prompts, seed, max_chunk, kind):
    layout, max_new = quant_layout(kind), 4
    runner, _, _ = make_runner(layout, fill=0xFF)
    want = {rid: solo(runner, p, max_new) for rid, p in enumerate(prompts)}
    runner, _, _ = make_runner(layout, fill=0x7F)
    got, stats = drive(runner, dict(enumerate(prompts)), max_new, np.random.default_rng(seed),
                       max_chunk=max_chunk, preempt_prob=0.3)
    assert got == want, stats


def test_outputs_are_not_degenerate():
    runner, _, _ = make_runner()
    outs = {tuple(solo(runner, [t, t + 1, t + 2], 6)) for t in range(0, 400, 40)}
    assert len(outs) >= 8, "random weights should give different continuations for different prompts"
    assert len({tok for o in outs for tok in o}) > 20


# -- invariance under everything the scheduler varies ----------------------------------
PROMPTS = st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=14)


@settings(max_examples=25 * SCALE)
@given(prompts=st.lists(PROMPTS, min_size=1, max_size=4), seed=st.integers(0, 2**32 - 1),
       max_chunk=st.integers(1, 9), preempt=st.sampled_from([0.0, 0.3]))
def test_chunking_batching_placement_and_recompute_invariance(prompts, seed, max_chunk, preempt):
    max_new = 5
    runner, k, v = make_runner(fill=np.nan)  # unwritten slots are NaN: a read of one would poison the output
    want = {rid: solo(runner, p, max_new) for rid, p in enumerate(prompts)}
    runner, k, v = make_runner(fill=np.nan)
    got, stats = drive(runner, dict(enumerate(prompts)), max_new, np.random.default_rng(seed),
                       max_chunk=max_chunk, preempt_prob=preempt)
    assert got == want, stats


@settings(max_examples=10 * SCALE)
@given(prompt=PROMPTS, split=st.integers(1, 13), first=st.integers(0, 40))
def test_kv_bytes_do_not_depend_on_chunking_or_placement(prompt, split, first):
    """The KV of a sequence is bit-identical however it was computed (what prefix caching relies on)."""
    runner_a, ka, va = make_runner()
    solo(runner_a, prompt, 3)
    runner_b, kb, vb = make_runner()
    bs, n = LAYOUT.block_size, len(prompt)
    table = np.arange(first, first + -(-n // bs))
    for start in range(0, n, split):
        chunk = prompt[start : start + split]
        runner_b.step(StepPlan(0, [SeqWork(1, np.array(chunk), start, table, start + split >= n)]))
    table_a = np.arange(-(-n // bs))
    for layer in range(LAYOUT.num_layers):
        np.testing.assert_array_equal(seq_kv(LAYOUT, ka[layer], table_a, n), seq_kv(LAYOUT, kb[layer], table, n))
        np.testing.assert_array_equal(seq_kv(LAYOUT, va[layer], table_a, n), seq_kv(LAYOUT, vb[layer], table, n))


# -- memory discipline ----------------------------------------------------------------
def test_writes_land_in_place_and_only_in_the_new_slots():
    runner, k, v = make_runner(fill=0.0)
    before = [a.copy() for a in k + v]
    table = np.array([9, 2, 30])  # positions 0..11; the step computes 5..9
    runner.step(StepPlan(0, [SeqWork(4, np.arange(1, 11), 0, table, False)]))
    snapshot = [a.copy() for a in k + v]
    runner.step(StepPlan(1, [SeqWork(4, np.array([20, 21]), 10, table, True)]))
    bs = LAYOUT.block_size
    written = {(int(table[p // bs]), p % bs) for p in range(0, 12)}
    for a, b0 in zip(k + v, before, strict=True):
        changed = {(int(b), int(s)) for b, s in zip(*np.nonzero((a != b0).any(axis=(1, 3))), strict=True)}
        assert changed and changed <= written, "KV writes missed the shared buffer or strayed outside the slots"
    second = {(int(table[p // bs]), p % bs) for p in (10, 11)}
    for a, s0 in zip(k + v, snapshot, strict=True):
        changed = {(int(b), int(s)) for b, s in zip(*np.nonzero((a != s0).any(axis=(1, 3))), strict=True)}
        assert changed == second


def test_numpy_caches_are_accepted_and_written_in_place():
    runner, k, _ = make_runner(as_paddle=False)
    runner.step(StepPlan(0, [SeqWork(1, np.array([1, 2, 3]), 0, np.array([5]), True)]))
    assert np.any(k[0][5, :, :3] != 0) and not np.any(k[0][5, :, 3:]) and not np.any(np.delete(k[0], 5, axis=0))


def test_bad_input_is_rejected():
    runner, _, _ = make_runner()
    with pytest.raises(ValueError, match="vocab"):
        runner.step(StepPlan(0, [SeqWork(1, np.array([CFG.vocab]), 0, np.array([0]), True)]))
    with pytest.raises(ValueError, match="max_positions"):
        runner.step(StepPlan(0, [SeqWork(1, np.array([1]), CFG.max_positions, np.arange(65), True)]))
    with pytest.raises(ValueError, match="blocks"):
        runner.step(StepPlan(0, [SeqWork(1, np.arange(5), 0, np.array([0]), True)]))
    with pytest.raises(ValueError, match="float32"):
        make_runner(KVLayout(2, 2, 4, 16, dtype="bfloat16"))



def test_quantized_kv_on_accelerator_caches_is_refused(monkeypatch):
    from fastkv.engine.runners import base

    monkeypatch.setattr(base, "host_view", lambda tensor: None)  # as for tensors on a GPU
    with pytest.raises(ValueError, match="int8 KV mode needs host-memory caches"):
        make_runner(quant_layout("int8"))
    with pytest.raises(ValueError, match="collective"):
        k, v = caches(KVLayout(2, 1, 4, 16, dtype="float32", tp_size=2))
        TinyDecoderRunner(KVLayout(2, 1, 4, 16, dtype="float32", tp_size=2), 0, 2, k, v, config=CFG)
    with pytest.raises(ValueError, match="exact"):
        make_runner(cfg=TinyConfig(max_positions=1 << 20))


def test_paddle_only_path_for_accelerator_caches_matches_the_host_path():
    """Caches without a host view (a GPU build) are gathered and written with Paddle ops alone."""
    prompts = {1: [3, 4, 5, 6, 7, 8, 9], 2: [100, 7], 3: list(range(200, 213))}
    host, hk, hv = make_runner(fill=np.nan)
    want, _ = drive(host, prompts, 5, np.random.default_rng(5), max_chunk=4, preempt_prob=0.3)
    dev, dk, dv = make_runner(fill=np.nan)
    dev.k_views = [None] * LAYOUT.num_layers  # pretend the caches live on an accelerator
    dev.v_views = [None] * LAYOUT.num_layers
    got, _ = drive(dev, prompts, 5, np.random.default_rng(5), max_chunk=4, preempt_prob=0.3)
    assert got == want
    for a, b in zip(hk + hv, dk + dv, strict=True):  # same bytes, NaN where never written
        np.testing.assert_array_equal(a, b)

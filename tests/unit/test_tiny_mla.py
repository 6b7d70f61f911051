"""The tiny decoder's MLA mode: exact against a cache-free numpy reference (tokens and the
cached latent's bits), and invariant to everything a scheduler varies."""
from __future__ import annotations

import math
import os

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fastkv.config import KVLayout
from fastkv.engine.runners.tiny_config import mla_dims
from fastkv.engine.runners.tiny_decoder import P_BITS, TinyConfig, TinyDecoderRunner, full_weights, rope_tables
from tests.runner_driver import drive, solo
from tests.unit.test_tiny_decoder import _g, _norm

SCALE = 4 if os.environ.get("CI") else 1
CFG = TinyConfig(vocab=512, hidden=64, intermediate=128, max_positions=256, seed=5)
LAYOUT = KVLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=32, dtype="float32", mla=True)


def make_runner(layout=LAYOUT, blocks=96, fill=0.0, cfg=CFG):
    lat = [np.full(layout.device_shape(blocks), fill, np.float32) for _ in range(layout.num_layers)]
    return TinyDecoderRunner(layout, 0, 1, lat, [], config=cfg), lat


def mla_reference(prompt, max_new, layout=LAYOUT, cfg=CFG):
    """Greedy tokens and the final latents [layers][n, D], the whole sequence recomputed per token."""
    D = layout.head_dim
    c, r, dh = mla_dims(D)
    nh = cfg.mla_q_heads()
    w = full_weights(cfg, layout.num_layers, 1, D, mla=True)
    cos, sin = rope_tables(cfg, r)

    def rope(x, pos):  # x [n, heads, r]
        co, si = cos[pos][:, None], sin[pos][:, None]
        x1, x2 = x[..., : r // 2], x[..., r // 2 :]
        return _g(np.concatenate([x1 * co - x2 * si, x2 * co + x1 * si], -1))

    tokens, out = list(prompt), []
    for _ in range(max_new):
        n = len(tokens)
        pos = np.arange(n)
        x = w["embed"][tokens]
        latents = []
        for i in range(layout.num_layers):
            h = _norm(x, w[f"{i}.ln1"])
            q = _g(h @ w[f"{i}.wq"]).reshape(n, nh, dh + r)
            q = np.concatenate([q[..., :dh], rope(q[..., dh:], pos)], -1)
            lat = _g(h @ w[f"{i}.wdkv"])
            lat = np.concatenate([lat[:, :c], rope(lat[:, None, c:], pos)[:, 0]], -1)
            latents.append(lat)
            k_nope = _g(lat[:, :c] @ w[f"{i}.wuk"]).reshape(n, nh, dh)
            v = _g(lat[:, :c] @ w[f"{i}.wuv"]).reshape(n, nh, dh)
            o = np.empty((n, nh, dh))
            for head in range(nh):
                k = np.concatenate([k_nope[:, head], lat[:, c:]], -1)
                s = q[:, head] @ k.T * (1.0 / math.sqrt(dh + r))
                s = np.where(np.tril(np.ones((n, n), bool)), s, -np.inf)
                p = _g(np.exp(s - s.max(-1, keepdims=True)), P_BITS)
                o[:, head] = _g(p @ v[:, head] / p.sum(-1, keepdims=True))
            x = _g(x + _g(o.reshape(n, nh * dh) @ w[f"{i}.wo"]))
            h = _norm(x, w[f"{i}.ln2"])
            gate, up = _g(h @ w[f"{i}.wg"]), _g(h @ w[f"{i}.wu"])
            x = _g(x + _g(_g(gate * _g(1 / (1 + np.exp(-gate)), P_BITS) * up) @ w[f"{i}.wd"]))
        logits = _norm(x[-1:], w["norm"]) @ w["lm_head"]
        tokens.append(int(np.argmax(logits[0])))
        out.append(tokens[-1])
    return out, latents


def test_mla_matches_the_cache_free_reference_tokens_and_latent_bits():
    prompt = [5, 77, 300, 12, 9, 401, 250]
    want, latents = mla_reference(prompt, 6)
    runner, lat = make_runner(fill=np.nan)  # an unwritten slot read would poison the output
    assert solo(runner, prompt, 6) == want
    n = len(prompt) + 5  # the last sampled token was never fed
    table = np.arange(-(-(len(prompt) + 6) // LAYOUT.block_size))
    for layer in range(LAYOUT.num_layers):
        rows = lat[layer][table].reshape(-1, LAYOUT.head_dim)[:n]  # [blocks, 1, bs, D] -> token rows
        np.testing.assert_array_equal(rows, latents[layer][:n].astype(np.float32))


def test_mla_outputs_are_not_degenerate():
    runner, _ = make_runner()
    outs = {tuple(solo(runner, [t, t + 1, t + 2], 6)) for t in range(0, 400, 40)}
    assert len(outs) >= 8, "random weights should give different continuations for different prompts"


@settings(max_examples=10 * SCALE, deadline=None)
@given(prompts=st.lists(st.lists(st.integers(0, CFG.vocab - 1), min_size=1, max_size=14), min_size=1, max_size=3),
       seed=st.integers(0, 2**32 - 1), max_chunk=st.integers(1, 9), preempt=st.sampled_from([0.0, 0.3]))
def test_mla_is_invariant_to_chunking_batching_placement_and_recompute(prompts, seed, max_chunk, preempt):
    runner, _ = make_runner(fill=np.nan)
    want = {rid: solo(runner, p, 4) for rid, p in enumerate(prompts)}
    runner, _ = make_runner(fill=np.nan)
    got, stats = drive(runner, dict(enumerate(prompts)), 4, np.random.default_rng(seed), max_chunk=max_chunk,
                       preempt_prob=preempt)
    assert got == want, stats


def test_mla_mode_refuses_bad_shapes():
    with pytest.raises(ValueError, match="head_dim a multiple of 8"):
        make_runner(KVLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=12, dtype="float32", mla=True))
    with pytest.raises(ValueError, match="num_q_heads 3 must be a multiple of tp_size 2"):
        TinyConfig(num_q_heads=3).check(
            KVLayout(num_layers=1, kv_heads=1, block_size=4, head_dim=16, dtype="float32", tp_size=2, mla=True))
    with pytest.raises(ValueError, match="latent caches and no V"):
        TinyDecoderRunner(LAYOUT, 0, 1, make_runner()[1], make_runner()[1], config=CFG)

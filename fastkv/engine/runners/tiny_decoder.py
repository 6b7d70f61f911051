"""A small Paddle transformer over the paged KV cache whose greedy outputs never depend on batching.

Why fixed point. Floating-point sums give different bits for different summation orders,
and a GEMM's order depends on its shape: the same token computed in a prefill of 7, a
chunk of 3 or alone would differ in the last bits, and sooner or later an argmax flips.
Here every tensor that enters a matmul or a sum holds multiples of a power-of-two grid
with bounded magnitude (activations: multiples of 2^-12 clipped to +-256; weights:
multiples of 2^-12 in (-1, 1); probabilities: multiples of 2^-16), so every product and
partial sum is an exact float64 (< 2^53 grid units) and any order gives the same bits.
Between reductions, values are re-rounded to the grid by elementwise ops, which are the
same IEEE operation on the same inputs whatever the batch. exp, sigmoid and the RoPE
tables are rounded to a 2^-16 / 2^-14 grid, so a 1-ulp difference between vectorized and
scalar libm paths could only matter if it straddled a grid point (~2^-36 per element).
K and V are exact in float32 (<= 21 significant bits), so the cache is float32: a 16-bit
cache would need rounding on write and re-gridding on read, and Paddle's CPU gather has
no float16 kernel.

A quantized layout (fp8_e4m3 or int8, ``KVLayout.quant``) quantizes K and V on write and
dequantizes on read (``kv_quant``): power-of-two scales of at least 2^-12 / the code's step keep
what is read back on the 2^-12 grid (one more bit of magnitude, in the exactness budget), so the
outputs are still exact, and equal those of a cache-free model that rounds K and V the same way.

The model: token embedding, ``num_layers`` blocks of RMSNorm -> GQA attention with RoPE ->
residual -> RMSNorm -> SwiGLU MLP -> residual, final RMSNorm, untied LM head; weights
drawn from ``seed`` and the weights version (``weights_seed``; ``load_weights`` switches).
Tensor parallel over KV heads: rank r owns KV heads [r*h, (r+1)*h)
and their query heads, writes only its KV shard, and the ranks all-gather per-head
attention outputs before the (replicated) output projection; exact arithmetic makes
tp=2 bit-identical to tp=1.

MLA mode (``KVLayout.mla``): DeepSeek's multi-head latent attention, in its naive form. Each
token's latent (``head_dim`` = C content dims and R RoPE dims, ``mla_dims``) is projected
from the normed hidden state, its RoPE part rotated, and cached: one row per token and layer.
Attention decompresses each head's K (its C / 2 dims, then the shared R rotated dims) and V
from the cached content part. Every rank computes and caches the whole latent (the same bytes)
and owns a slice of the query heads.
"""
from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Sequence
from typing import Any

import numpy as np
import paddle
import xxhash

from fastkv.config import KVLayout
from fastkv.engine.runners import kv_quant
from fastkv.engine.runners.base import ModelRunner
from fastkv.engine.runners.tiny_config import ACT_BITS, CLIP, P_BITS, TinyConfig, mla_dims
from fastkv.ipc.collective import ShmCollective
from fastkv.sched.output import StepOutput, StepPlan, validate_plan

TRIG_BITS = 14  # RoPE cos/sin tables
EPS = 2.0**-20


def _grid(x: np.ndarray, bits: int, bound: float) -> np.ndarray:
    s = float(2**bits)
    return np.clip(np.round(x * s) / s, -bound, bound)


def full_weights(cfg: TinyConfig, num_layers: int, total_kv_heads: int, head_dim: int,
                 mla: bool = False) -> dict[str, np.ndarray]:
    """The whole (tp=1) model's weights, float64 on the grid, drawn in a fixed order from ``cfg.seed``.
    ``mla``: the MLA mode's attention (``head_dim`` is the latent's), whose names differ."""
    rng = np.random.default_rng(cfg.seed)
    H, inter, q = cfg.hidden, cfg.intermediate, cfg.q_heads(total_kv_heads)
    wmax = 1.0 - 2.0**-ACT_BITS

    def linear(fan_in: int, fan_out: int) -> np.ndarray:
        return _grid(rng.standard_normal((fan_in, fan_out)) / math.sqrt(fan_in), ACT_BITS, wmax)

    def gain(n: int) -> np.ndarray:
        return _grid(1.0 + 0.1 * rng.standard_normal(n), ACT_BITS, 2.0)

    w = {"embed": _grid(rng.standard_normal((cfg.vocab, H)), ACT_BITS, 4.0)}
    for i in range(num_layers):
        w[f"{i}.ln1"] = gain(H)
        if mla:
            q, (c, r, dh) = cfg.mla_q_heads(), mla_dims(head_dim)
            w[f"{i}.wq"] = linear(H, q * (dh + r))  # per head: dh content dims, then r RoPE dims
            w[f"{i}.wdkv"] = linear(H, head_dim)  # the latent: c content dims, then r RoPE dims
            w[f"{i}.wuk"] = linear(c, q * dh)
            w[f"{i}.wuv"] = linear(c, q * dh)
            w[f"{i}.wo"] = linear(q * dh, H)
        else:
            w[f"{i}.wq"] = linear(H, q * head_dim)
            w[f"{i}.wk"] = linear(H, total_kv_heads * head_dim)
            w[f"{i}.wv"] = linear(H, total_kv_heads * head_dim)
            w[f"{i}.wo"] = linear(q * head_dim, H)
        w[f"{i}.ln2"] = gain(H)
        w[f"{i}.wg"] = linear(H, inter)
        w[f"{i}.wu"] = linear(H, inter)
        w[f"{i}.wd"] = linear(inter, H)
    w["norm"] = gain(H)
    w["lm_head"] = linear(H, cfg.vocab)
    return w


def weights_seed(seed: int, weights_version: str) -> int:
    """The seed of ``weights_version``'s weights: any string, hashed with the config's seed;
    version "0" (the default) keeps ``seed`` itself."""
    if str(weights_version) == "0":
        return seed
    return xxhash.xxh3_64_intdigest(f"{seed}/{weights_version}".encode()) >> 1


def _t(a: np.ndarray) -> paddle.Tensor:
    return paddle.to_tensor(np.ascontiguousarray(a), dtype="float64")


def rope_tables(cfg: TinyConfig, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin [max_positions, head_dim // 2] on the 2^-14 grid."""
    inv = cfg.rope_theta ** (-np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.arange(cfg.max_positions, dtype=np.float64)[:, None] * inv[None, :]
    return _grid(np.cos(ang), TRIG_BITS, 1.0), _grid(np.sin(ang), TRIG_BITS, 1.0)


def _q(x: paddle.Tensor, bits: int = ACT_BITS) -> paddle.Tensor:
    """Round to the 2^-bits grid and clip: exact, elementwise, batch independent."""
    s = float(2**bits)
    return paddle.clip(paddle.round(x * s) * (1.0 / s), -CLIP, CLIP)


def _rms_norm(x: paddle.Tensor, gain: paddle.Tensor) -> paddle.Tensor:
    ms = paddle.sum(x * x, axis=-1, keepdim=True) / x.shape[-1]  # exact sum, one rounding
    return _q(x / paddle.sqrt(ms + EPS) * gain)


def _rope(x: paddle.Tensor, cos: paddle.Tensor, sin: paddle.Tensor) -> paddle.Tensor:
    """x [T, heads, D]; cos/sin [T, 1, D/2]; rotate-half RoPE."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return _q(paddle.concat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1))


class TinyDecoderRunner(ModelRunner):
    """The tiny decoder on one rank. ``collective`` (attached, rank = ``rank``) is required when tp_size > 1."""

    layerwise = True  # calls wait_layer before each layer's KV (ModelRunner)

    def __init__(
        self,
        layout: KVLayout,
        rank: int,
        tp_size: int,
        k_caches: Sequence[Any],
        v_caches: Sequence[Any],
        *,
        config: TinyConfig | None = None,
        collective: ShmCollective | None = None,
        weights_version: str = "0",
    ) -> None:
        if layout.is_hybrid:  # its attention is full in every layer: a sliding group's table would lose keys
            raise ValueError("the tiny runner has no sliding-window layers: give it a KVLayout without windows")
        super().__init__(layout, rank, tp_size, k_caches, v_caches)
        self.config = cfg = config or TinyConfig()
        cfg.check(layout)
        if tp_size > 1 and (collective is None or collective.rank != rank or collective.world_size != tp_size):
            raise ValueError(f"tp_size {tp_size} needs a collective attached as rank {rank} of {tp_size}")
        self.collective = collective
        D, h = layout.head_dim, layout.kv_heads
        self.total_kv_heads = h * tp_size
        self.q_heads = cfg.q_heads(self.total_kv_heads) // tp_size  # this rank's
        rope_dims, qk_dims = D, D
        if layout.mla:
            if layout.quant:
                raise ValueError("the tiny decoder's MLA mode takes a float32 latent")
            _, rope_dims, dh = mla_dims(D)
            qk_dims = dh + rope_dims
            self.q_heads = cfg.mla_q_heads() // tp_size
        cos, sin = rope_tables(cfg, rope_dims)
        self.cos, self.sin = _t(cos), _t(sin)
        self.scale = 1.0 / math.sqrt(qk_dims)
        self.load_weights(weights_version)

    @property
    def min_scale(self) -> float:
        """The smallest quantization scale: a grid value small enough for it is stored exactly."""
        return 2.0**-ACT_BITS / kv_quant.QUANTUM[self.layout.quant]

    def set_caches(self, k_caches: Sequence[Any], v_caches: Sequence[Any]) -> None:
        super().set_caches(k_caches, v_caches)
        # Numpy caches are wrapped zero-copy so attention can gather blocks in Paddle.
        wrap = lambda c: paddle.utils.dlpack.from_dlpack(c.__dlpack__()) if isinstance(c, np.ndarray) else c
        self.k_caches = [wrap(c) for c in self.k_caches]
        self.v_caches = [wrap(c) for c in self.v_caches]
        if self.layout.quant and any(view is None for view in (*self.k_views, *self.v_views)):
            raise ValueError(f"the tiny decoder's {self.layout.quant} KV mode needs host-memory caches")

    def load_weights(self, weights_version: str) -> None:
        """This rank's shard of the weights drawn from ``weights_seed(config.seed, weights_version)``."""
        layout, D, h, rank = self.layout, self.layout.head_dim, self.layout.kv_heads, self.rank
        kv_cols = slice(rank * h * D, (rank + 1) * h * D)
        q_cols = slice(rank * self.q_heads * D, (rank + 1) * self.q_heads * D)
        cfg = dataclasses.replace(self.config, seed=weights_seed(self.config.seed, weights_version))
        full = full_weights(cfg, layout.num_layers, self.total_kv_heads, D, mla=layout.mla)
        self.embed, self.norm, self.lm_head = _t(full["embed"]), _t(full["norm"]), _t(full["lm_head"])
        self.layers = []
        for i in range(layout.num_layers):
            gate_up = np.concatenate([full[f"{i}.wg"], full[f"{i}.wu"]], axis=1)
            w = dict(ln1=_t(full[f"{i}.ln1"]), wo=_t(full[f"{i}.wo"]), ln2=_t(full[f"{i}.ln2"]),
                     gate_up=_t(gate_up), wd=_t(full[f"{i}.wd"]))
            if layout.mla:  # this rank's query heads; the latent's projection whole
                _, r, dh = mla_dims(D)
                n0, n1 = rank * self.q_heads, (rank + 1) * self.q_heads
                w.update(wq=_t(full[f"{i}.wq"][:, n0 * (dh + r) : n1 * (dh + r)]), wdkv=_t(full[f"{i}.wdkv"]),
                         wuk=_t(full[f"{i}.wuk"][:, n0 * dh : n1 * dh]), wuv=_t(full[f"{i}.wuv"][:, n0 * dh : n1 * dh]))
            else:
                wq, wk, wv = full[f"{i}.wq"][:, q_cols], full[f"{i}.wk"][:, kv_cols], full[f"{i}.wv"][:, kv_cols]
                w["qkv"] = _t(np.concatenate([wq, wk, wv], axis=1))
            self.layers.append(w)
        self.weights_version = str(weights_version)

    # -- one step ---------------------------------------------------------------------
    def step(self, plan: StepPlan) -> StepOutput:
        t0 = time.perf_counter()
        validate_plan(plan, self.layout.block_size, self.num_device_blocks)
        seqs = plan.seqs
        if not seqs:
            return StepOutput(plan.step_id, {}, time.perf_counter() - t0)
        cfg = self.config
        for s in seqs:
            if s.end_pos > cfg.max_positions:
                raise ValueError(
                    f"request {s.request_id} reaches position {s.end_pos} > max_positions {cfg.max_positions}"
                )
            if int(s.token_ids.max()) >= cfg.vocab:
                raise ValueError(f"request {s.request_id} has a token id >= vocab {cfg.vocab}")
        b = _Batch(seqs, self.layout.block_size)
        x = paddle.gather(self.embed, b.token_ids)
        cos = paddle.gather(self.cos, b.positions).unsqueeze(1)
        sin = paddle.gather(self.sin, b.positions).unsqueeze(1)
        D, h, g = self.layout.head_dim, self.layout.kv_heads, self.q_heads // self.layout.kv_heads
        for i, w in enumerate(self.layers):
            self.wait_layer(plan, i)  # layer i's KV of the copies in flight has landed
            hn = _rms_norm(x, w["ln1"])
            if self.layout.mla:
                o = self._mla(i, hn, w, b, cos, sin)
            else:
                qkv = _q(paddle.matmul(hn, w["qkv"]))
                qn = self.q_heads * D
                q = _rope(qkv[:, :qn].reshape([-1, self.q_heads, D]), cos, sin)
                k = _rope(qkv[:, qn : qn + h * D].reshape([-1, h, D]), cos, sin)
                v = qkv[:, qn + h * D :].reshape([-1, h, D])
                self._write_kv(i, k, v, b)
                kc, vc = self._gather(i, b)
                o = self._attend(q, kc, vc, b, h, g)  # [T, q_heads * D]
            if self.collective is not None:
                o = paddle.to_tensor(np.concatenate(self.collective.all_gather(o.numpy()), axis=1))
            x = _q(x + _q(paddle.matmul(o, w["wo"])))
            gu = _q(paddle.matmul(_rms_norm(x, w["ln2"]), w["gate_up"]))
            gate, up = gu[:, : cfg.intermediate], gu[:, cfg.intermediate :]
            act = _q(gate * _q(paddle.nn.functional.sigmoid(gate), P_BITS) * up)
            x = _q(x + _q(paddle.matmul(act, w["wd"])))
        sampled: dict[int, int] = {}
        if len(b.sample_rows):
            last = paddle.gather(x, paddle.to_tensor(b.sample_rows))
            logits = paddle.matmul(_rms_norm(last, self.norm), self.lm_head).numpy()
            # numpy's argmax breaks ties by the lowest id, whatever the row count.
            for rid, tok in zip(b.sample_ids, np.argmax(logits, axis=1), strict=True):
                sampled[rid] = int(tok)
        return StepOutput(plan.step_id, sampled, time.perf_counter() - t0)

    def _mla(self, layer: int, hn: paddle.Tensor, w: dict, b: _Batch, cos: paddle.Tensor,
             sin: paddle.Tensor) -> paddle.Tensor:
        """MLA attention of the new tokens (normed hidden ``hn`` [T, H]): write their latents, then
        attend over each sequence's cached latents. Returns [T, q_heads * dh]."""
        c, r, dh = mla_dims(self.layout.head_dim)
        nh = self.q_heads
        q = _q(paddle.matmul(hn, w["wq"])).reshape([-1, nh, dh + r])
        q = paddle.concat([q[..., :dh], _rope(q[..., dh:], cos, sin)], axis=-1)
        lat = _q(paddle.matmul(hn, w["wdkv"]))
        lat = paddle.concat([lat[:, :c], _rope(lat[:, c:].unsqueeze(1), cos, sin).squeeze(1)], axis=-1)
        self._write_kv(layer, lat.unsqueeze(1), None, b)
        cached, _ = self._gather(layer, b)  # [S, nb, 1, bs, c + r]; zero past each sequence's end
        S, nb, _, bs, _ = cached.shape
        heads = lambda t: t.reshape([S, nb, bs, nh, dh]).transpose([0, 1, 3, 2, 4])  # noqa: E731
        k_nope = heads(_q(paddle.matmul(cached[..., :c], w["wuk"])))
        v = heads(_q(paddle.matmul(cached[..., :c], w["wuv"])))
        k = paddle.concat([k_nope, cached[..., c:].expand([S, nb, nh, bs, r])], axis=-1)
        return self._attend(q, k, v, b, nh, 1)

    def _write_kv(self, layer: int, k: paddle.Tensor, v: paddle.Tensor | None, b: _Batch) -> None:
        """Store the new tokens' K/V [T, h, D] (MLA: latents [T, 1, D], no V) in their slots, in
        place, touching no other slot."""
        pairs = ((self.k_views, self.k_caches, k), (self.v_views, self.v_caches, v))
        for views, caches, val in pairs[: self.layout.kv_pages]:
            if self.layout.quant:  # the values' bytes and their scales, one row per token-head
                rows = kv_quant.quantize(val.numpy(), self.layout.quant, self.min_scale)
                views[layer][b.slot_blocks, :, b.slot_offsets, :] = rows
            elif views[layer] is not None:
                views[layer][b.slot_blocks, :, b.slot_offsets, :] = val.numpy().astype(np.float32)
            else:  # an accelerator tensor: Paddle's index_put writes in place
                caches[layer][paddle.to_tensor(b.slot_blocks), :, paddle.to_tensor(b.slot_offsets), :] = val.astype(
                    caches[layer].dtype
                )

    def _gather(self, layer: int, b: _Batch) -> tuple[paddle.Tensor, paddle.Tensor | None]:
        """K and V [S, blocks, h, block_size, D] float64 of every sequence's blocks, block-major.

        Slots past a sequence's length (the tail of its last block, padding blocks) hold
        another request's data or none: V there is zeroed so that 0 * garbage cannot become
        NaN (K there is masked out of the scores). MLA: the latents, zeroed there (they make V), and None.
        """
        if self.layout.mla:
            if self.k_views[layer] is not None:
                lat = self.k_views[layer][b.tables].astype(np.float64)
                lat[b.invalid[0], b.invalid[1], :, b.invalid[2], :] = 0.0
                return _from_numpy(lat), None
            idx = paddle.to_tensor(b.tables.reshape(-1))
            shape = [*b.tables.shape, *self.layout.device_shape(0)[1:]]
            lat = paddle.index_select(self.k_caches[layer], idx, axis=0).reshape(shape).astype("float64")
            return paddle.where(paddle.to_tensor(b.key_valid), lat, paddle.zeros_like(lat)), None
        if self.layout.quant:  # (garbage past a sequence's end may read as NaN: masked as below)
            with np.errstate(invalid="ignore", over="ignore"):
                k = kv_quant.dequantize(self.k_views[layer][b.tables], self.layout.quant)
                v = kv_quant.dequantize(self.v_views[layer][b.tables], self.layout.quant)
            v[b.invalid[0], b.invalid[1], :, b.invalid[2], :] = 0.0
            return _from_numpy(k), _from_numpy(v)
        if self.k_views[layer] is not None:  # host memory: numpy's gather beats Paddle's cast + where
            k = self.k_views[layer][b.tables].astype(np.float64)
            v = self.v_views[layer][b.tables].astype(np.float64)
            v[b.invalid[0], b.invalid[1], :, b.invalid[2], :] = 0.0
            return _from_numpy(k), _from_numpy(v)
        idx = paddle.to_tensor(b.tables.reshape(-1))
        shape = [*b.tables.shape, *self.layout.device_shape(0)[1:]]
        k = paddle.index_select(self.k_caches[layer], idx, axis=0).reshape(shape).astype("float64")
        v = paddle.index_select(self.v_caches[layer], idx, axis=0).reshape(shape).astype("float64")
        return k, paddle.where(paddle.to_tensor(b.key_valid), v, paddle.zeros_like(v))

    def _attend(self, q: paddle.Tensor, kc: paddle.Tensor, vc: paddle.Tensor, b: _Batch, h: int,
                g: int) -> paddle.Tensor:
        """Causal attention of the new tokens' queries [T, h * g, D] over each sequence's paged
        K [S, blocks, h, block_size, D] and V [..., Dv]: [T, h * g * Dv].

        Scores stay block-major [S, blocks, h, g*Q, block_size] so the gathered blocks are used
        as they lie (no transpose copy); softmax reduces over (blocks, slots).
        """
        D, Dv, bs = q.shape[-1], vc.shape[-1], self.layout.block_size
        S, Q, nb = len(b.starts), b.max_new, b.tables.shape[1]
        qp = paddle.gather(paddle.concat([q, paddle.zeros([1, *q.shape[1:]], q.dtype)]), b.pad_index)
        qp = qp.reshape([S, Q, h, g, D]).transpose([0, 2, 3, 1, 4]).reshape([S, 1, h, g * Q, D])
        scores = (paddle.matmul(qp, kc, transpose_y=True) * self.scale).reshape([S, nb, h, g, Q, bs])
        scores = paddle.where(b.visible, scores, paddle.full_like(scores, -math.inf))
        e = paddle.exp(scores - paddle.amax(scores, axis=[1, 5], keepdim=True))
        p = _q(e, P_BITS)
        denom = paddle.sum(p, axis=[1, 5])  # exact; >= 1 (the max term is 1)
        o = paddle.sum(paddle.matmul(p.reshape([S, nb, h, g * Q, bs]), vc), axis=1)  # exact
        o = _q(o.reshape([S, h, g, Q, Dv]) / denom.unsqueeze(-1))
        o = o.transpose([0, 3, 1, 2, 4]).reshape([S * Q, h * g * Dv])
        return paddle.gather(o, b.token_rows)


def _from_numpy(a: np.ndarray) -> paddle.Tensor:
    """Zero-copy: the array's memory becomes the tensor's (a fresh array nobody else holds)."""
    return paddle.utils.dlpack.from_dlpack(np.ascontiguousarray(a).__dlpack__())


class _Batch:
    """Index arrays of one step: token-major rows, padded per-sequence views, slots, masks."""

    def __init__(self, seqs, block_size: int) -> None:
        n = np.array([len(s.token_ids) for s in seqs])
        self.starts = np.array([s.start_pos for s in seqs])
        ends = self.starts + n
        S, Q = len(seqs), int(n.max())
        self.max_new = Q
        nb = -(-int(ends.max()) // block_size)
        self.tables = np.zeros((S, nb), np.int64)  # padding reads block 0; masked below
        seq_of = np.repeat(np.arange(S), n)
        row_in_seq = np.arange(int(n.sum())) - np.repeat(np.cumsum(n) - n, n)
        positions = np.repeat(self.starts, n) + row_in_seq
        blocks, offsets = [], []
        for i, s in enumerate(seqs):
            used = -(-int(ends[i]) // block_size)
            self.tables[i, :used] = s.block_table[:used]
            blocks.append(s.block_table[positions[seq_of == i] // block_size])
        offsets = positions % block_size
        self.slot_blocks = np.concatenate(blocks).astype(np.int64)
        self.slot_offsets = offsets.astype(np.int64)
        self.token_ids = paddle.to_tensor(np.concatenate([s.token_ids for s in seqs]).astype(np.int64))
        self.positions = paddle.to_tensor(positions.astype(np.int64))
        self.token_rows = paddle.to_tensor((seq_of * Q + row_in_seq).astype(np.int64))
        # Padded query slot (i, r) takes token row t, or the zero row T past the end.
        pad = np.full((S, Q), int(n.sum()), np.int64)
        pad[seq_of, row_in_seq] = np.arange(int(n.sum()))
        self.pad_index = paddle.to_tensor(pad.reshape(-1))
        # Key j = block * block_size + slot. Query row r of sequence i sees keys 0..start+r;
        # padding rows repeat the last real row so no row is fully masked (outputs dropped).
        r = np.minimum(np.arange(Q)[None, :], (n - 1)[:, None])  # [S, Q]
        keys = np.arange(nb * block_size).reshape(nb, 1, block_size)  # [nb, 1, bs]
        visible = keys[None, :, :, None, :] <= (self.starts[:, None] + r)[:, None, None, :, None]
        self.visible = paddle.to_tensor(visible[:, :, None])  # [S, nb, 1, 1, Q, bs]
        valid = keys[None, :, 0, :] < ends[:, None, None]  # [S, nb, bs]
        self.key_valid = valid[:, :, None, :, None]  # [S, nb, 1, bs, 1]
        self.invalid = np.nonzero(~valid)
        self.sample_rows = np.array([int(np.cumsum(n)[i]) - 1 for i, s in enumerate(seqs) if s.sample], np.int64)
        self.sample_ids = [s.request_id for s in seqs if s.sample]

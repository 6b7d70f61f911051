"""The tiny decoder's hyper-parameters and their checks, apart from the runner so that a job
is checked before anything imports Paddle (``fastkv.engine.runners.tiny_decoder`` runs it)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from fastkv.config import KVLayout

ACT_BITS = 12  # activations, K, V, weights: multiples of 2^-12
P_BITS = 16  # softmax numerators and sigmoid: multiples of 2^-16 in [0, 1]
CLIP = 256.0  # activation magnitude bound


def mla_dims(latent_dim: int) -> tuple[int, int, int]:
    """The MLA mode's (content dims C, RoPE dims R, per-head dims) of a latent of ``latent_dim``
    = C + R values: R a quarter of it, each head's K and V C / 2 dims decompressed from the C."""
    rope = latent_dim // 4
    return latent_dim - rope, rope, (latent_dim - rope) // 2


@dataclass(frozen=True, slots=True)
class TinyConfig:
    """Model hyper-parameters; layers, KV heads and head_dim come from the KVLayout (times tp_size)."""

    vocab: int = 1024
    hidden: int = 256
    intermediate: int = 512
    num_q_heads: int | None = None  # default: 4, or the number of KV heads if more
    max_positions: int = 8192
    rope_theta: float = 10000.0
    seed: int = 0

    def q_heads(self, total_kv_heads: int) -> int:
        return self.num_q_heads or total_kv_heads * max(1, 4 // total_kv_heads)

    def mla_q_heads(self) -> int:
        """Query heads of the MLA mode (every head reads the one latent): 4 by default."""
        return self.num_q_heads or 4

    def check(self, layout: KVLayout) -> None:
        kv = layout.kv_heads * layout.tp_size
        q = self.q_heads(kv)
        if layout.mla:
            q = self.mla_q_heads()
            if q % layout.tp_size:
                raise ValueError(f"num_q_heads {q} must be a multiple of tp_size {layout.tp_size}")
            if layout.head_dim % 8:
                raise ValueError(f"the MLA latent needs head_dim a multiple of 8 (a quarter of it is RoPE "
                                 f"dims, an even number), got {layout.head_dim}")
        elif q % kv:
            raise ValueError(f"num_q_heads {q} must be a multiple of the {kv} KV heads")
        if layout.head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {layout.head_dim}")
        if layout.dtype != "float32" and not layout.quant:
            raise ValueError(f"the tiny decoder needs a float32 or quantized KV layout, got {layout.dtype}")
        # Exactness budget (bits of grid units, must stay < 53): a reduction of K terms of
        # a x b units takes bits(a) + bits(b) + log2(K).
        act = ACT_BITS + int(math.log2(CLIP))  # 20
        kv = act + (1 if layout.quant else 0)  # a dequantized value may pass CLIP by half a scale
        budgets = {
            "hidden": act + ACT_BITS + math.log2(max(self.hidden, q * layout.head_dim)),
            "intermediate": act + ACT_BITS + math.log2(self.intermediate),
            "head_dim": act + kv + math.log2(layout.head_dim),
            "max_positions": P_BITS + 1 + kv + math.log2(self.max_positions),
        }
        for name, bits in budgets.items():
            if bits > 52:
                raise ValueError(f"{name} too large for exact fixed-point sums ({bits:.1f} bits > 52)")
        for name in ("vocab", "hidden", "intermediate", "max_positions"):
            if getattr(self, name) < 1:
                raise ValueError(f"TinyConfig.{name} must be positive")

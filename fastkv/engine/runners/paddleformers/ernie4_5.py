"""PaddleFormers' ``Ernie4_5ForCausalLM`` (``--runner paddleformers:ernie4_5``), the dense ERNIE
4.5 models: full attention in every layer, grouped-query attention with a fused QKV projection,
interleaved RoPE, a fused gate/up MLP; run by its own ``forward`` on fastkv's cache
(``runner.py``), which its attention calls as Llama's does.

Tensor parallel, from the library's layouts:
- ``qkv_proj``'s output columns are [kv_heads, (groups + 2) * head_dim]: per KV head its
  ``groups`` query heads, then its K, then its V (the attention reshapes to that and splits the
  last axis). Rank r's contiguous 1/tp of the columns is therefore exactly its KV heads with
  their query heads, K and V; ``o_proj``'s input rows are the query heads in order, so its
  contiguous row shard matches.
- The attention reshapes by its ``num_heads`` and ``num_key_value_heads`` attributes: they
  become per rank (``num_key_value_groups`` is unchanged).
- ``mlp.up_gate_proj`` is [gate | up] (``MLP.forward`` chunks its output in halves, gate first):
  each half is column sharded on its own; ``down_proj`` is row sharded.
"""
from __future__ import annotations

from paddleformers.transformers import Ernie4_5Config, Ernie4_5ForCausalLM

from fastkv.engine.runners.paddleformers.runner import PaddleFormersRunner, Split


class PaddleFormersErnie45Runner(PaddleFormersRunner):
    family = "ernie4_5"
    config_class = Ernie4_5Config
    model_class = Ernie4_5ForCausalLM

    @staticmethod
    def shard(model: Ernie4_5ForCausalLM, split: Split) -> None:
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.qkv_proj = split.cols(attn.qkv_proj)
            attn.o_proj = split.rows(attn.o_proj)
            attn.num_heads //= split.tp
            attn.num_key_value_heads //= split.tp
            mlp.up_gate_proj = split.cols(mlp.up_gate_proj, parts=2)
            mlp.down_proj = split.rows(mlp.down_proj)

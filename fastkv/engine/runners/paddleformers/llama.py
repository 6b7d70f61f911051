"""PaddleFormers' ``LlamaForCausalLM`` (``--runner paddleformers:llama``): its embedding, decoder
layers (RoPE, grouped-query attention, MLP, RMSNorm), LM head and masks, run by its own
``forward`` on fastkv's cache (``runner.py``).

Tensor parallel: separate q/k/v_proj, each column sharded (query head i belongs to KV head
i // groups, so rank r's contiguous query heads are those of its KV heads); o_proj row sharded;
the MLP's gate_proj and up_proj column sharded, down_proj row sharded. The attention reshapes
by ``-1`` heads, so no attribute counts heads per rank.
"""
from __future__ import annotations

from paddleformers.transformers import LlamaConfig, LlamaForCausalLM

from fastkv.engine.runners.paddleformers.runner import PaddleFormersRunner, Split


class PaddleFormersLlamaRunner(PaddleFormersRunner):
    family = "llama"
    config_class = LlamaConfig
    model_class = LlamaForCausalLM

    @staticmethod
    def shard(model: LlamaForCausalLM, split: Split) -> None:
        for layer in model.model.layers:
            attn, mlp = layer.self_attn, layer.mlp
            attn.q_proj, attn.k_proj, attn.v_proj = split.cols(attn.q_proj), split.cols(attn.k_proj), \
                split.cols(attn.v_proj)
            attn.o_proj = split.rows(attn.o_proj)
            mlp.gate_proj, mlp.up_proj = split.cols(mlp.gate_proj), split.cols(mlp.up_proj)
            mlp.down_proj = split.rows(mlp.down_proj)

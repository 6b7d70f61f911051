"""PaddleFormers' ``GptOssForCausalLM`` (``--runner paddleformers:gpt_oss``): sliding-window and
full attention layers alternating (``layer_types``), attention sinks (one learned logit per
query head, ``self_attn.sinks``, that takes a share of the softmax and no value), biased q/k/v/o
projections and a mixture-of-experts MLP; run by its own ``forward`` on fastkv's cache
(``runner.py``), which caches each sliding layer's window in its KV cache group (or, with groups
off, every layer in full) and windows the sliding layers' masks.

With one expert only: the library's inference MoE (``GptOssExperts.forward`` in eval mode) is
not per token when there are several. ``routing_weights.transpose([0, 1])`` is Paddle's
identity permutation (the port of torch's ``transpose(0, 1)``), so reshaping the [tokens,
experts] weights to [experts, batch, tokens] pairs each expert's output with another token's
weight: a position's output depends on the tokens after it in the same forward, and neither a
cache nor the no-cache forward's own greedy decoding is consistent with a prefix of it
(``paddleformers_config.FAMILIES`` refuses more than one expert).

Its ``generate()`` equals the no-cache forward here because it uses no cache:
``prepare_inputs_for_generation`` defaults ``use_cache`` to False, so every step runs the
whole sequence again.

Tensor parallel: q/k/v_proj column sharded (query head i belongs to KV head i // groups), o_proj
row sharded, the sinks of this rank's query heads; the attention reshapes by its ``num_heads``
and ``num_key_value_heads``. The expert and the router are replicated: every rank computes the
whole MLP on the whole hidden state.
"""
from __future__ import annotations

import paddle
from paddleformers.transformers import GptOssConfig, GptOssForCausalLM

from fastkv.engine.runners.paddleformers.runner import PaddleFormersRunner, Split


class PaddleFormersGptOssRunner(PaddleFormersRunner):
    family = "gpt_oss"
    config_class = GptOssConfig
    model_class = GptOssForCausalLM

    @staticmethod
    def shard(model: GptOssForCausalLM, split: Split) -> None:
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.q_proj, attn.k_proj, attn.v_proj = split.cols(attn.q_proj), split.cols(attn.k_proj), \
                split.cols(attn.v_proj)
            attn.o_proj = split.rows(attn.o_proj)
            attn.num_heads //= split.tp
            attn.num_key_value_heads //= split.tp
            sinks = attn.sinks.numpy()
            mine = sinks[split.rank * attn.num_heads : (split.rank + 1) * attn.num_heads]
            attn.sinks = paddle.create_parameter(list(mine.shape), str(mine.dtype),
                                                 default_initializer=paddle.nn.initializer.Assign(mine))

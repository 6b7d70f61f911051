"""PaddleFormers' ``Gemma3ForCausalLM`` (``--runner paddleformers:gemma3``, model_type
``gemma3_text``): sliding-window layers interleaved with full ones (``layer_types``,
``sliding_window``), q/k RMSNorm, a fused QKV projection and a fused gate/up MLP; run by its own
``forward`` on fastkv's cache (``runner.py``), which caches each sliding layer's window in its KV
cache group (or, with groups off, every layer in full) and windows the sliding layers' masks.

The library's own cached decode (``generate()``) is not this model once a sequence outgrows the
window: its sliding cache layer (``DynamicSlidingWindowLayer``) keeps only the last
``sliding_window - 1`` positions and returns them with the new ones, but the mask is still built
over every position so far, and the attention (``eager_attention_forward``) cuts it to the keys
it has by keeping its *first* columns (``attention_mask[..., :kv_len]``): a decode at position p
sees its window's keys under the mask of positions [0, kv_len), which lets through only
max(0, 2w - 1 - p) of them (w the window), and none at all from p >= 2w - 1, where the
softmax of an all-masked row is uniform. Position ids are right; cutting the mask to its last
columns instead makes ``generate()`` equal the no-cache forward (both checked). fastkv's tests
therefore take greedy decoding by the no-cache forward as the oracle, and show where
``generate()`` agrees with it (sequences within the window) and where it parts.

Tensor parallel: the same layouts as ERNIE 4.5 (``ernie4_5.py``): ``qkv_proj``'s columns are
grouped per KV head, ``mlp.up_gate_proj`` is [gate | up]; the attention reshapes by its
``num_heads`` and ``num_key_value_heads``. q_norm and k_norm act per head: replicated.
"""
from __future__ import annotations

from paddleformers.transformers import Gemma3ForCausalLM, Gemma3TextConfig

from fastkv.engine.runners.paddleformers.ernie4_5 import PaddleFormersErnie45Runner
from fastkv.engine.runners.paddleformers.runner import PaddleFormersRunner


class PaddleFormersGemma3Runner(PaddleFormersRunner):
    family = "gemma3"
    config_class = Gemma3TextConfig
    model_class = Gemma3ForCausalLM
    shard = staticmethod(PaddleFormersErnie45Runner.shard)

"""The PaddleFormers runners' model settings, per model family, checked against the KV layout
without importing Paddle or PaddleFormers (``fastkv.cli`` checks a job with it before anything
starts).

The settings are the family's config class's keyword arguments (``LlamaConfig``,
``Ernie4_5Config``, ``Gemma3TextConfig``, ``GptOssConfig``): runner option ``config`` (a table),
over the ``config.json`` named by runner option ``config_file``, over defaults derived from the
layout. The layout decides what
fastkv allocates (layers, KV heads, head_dim), so a setting that disagrees with it is an error
rather than a silent second truth.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastkv.config import KVLayout

OPTIONS = ("config", "config_file", "seed")  # the runner's keyword options (besides the collective)
# Settings fastkv owns or that the CPU build cannot run: the fused RMSNorm has no CPU kernel, and
# tensor parallelism is fastkv's (the workers' collective), not the library's.
FIXED = {"fuse_rms_norm": False, "tensor_model_parallel_size": 1, "sequence_parallel": False}


@dataclass(frozen=True)
class Family:
    """What the settings check knows of a model family (its runner is ``paddleformers/<name>.py``)."""

    config_class: str  # the library's config class, for messages
    fixed: dict[str, Any]  # settings fastkv owns or that this build cannot run
    hidden_is_heads: bool  # hidden_size must be num_attention_heads x head_dim
    sliding: bool = False  # layers may be sliding-window ones (layer_types, sliding_window)
    full_every: int = 0  # sliding: the library's default layer_types, every this many-th layer full


FAMILIES = {
    "llama": Family("LlamaConfig", FIXED, hidden_is_heads=True),
    # The fused RoPE rotates by each forward's own 0..n-1 (it takes no position ids): wrong for a
    # chunk or a decode over a cache, and a GPU kernel. ERNIE 4.5's configs have
    # num_attention_heads x head_dim != hidden_size (0.3B: 16 x 128 over 1024): o_proj maps back.
    "ernie4_5": Family("Ernie4_5Config", {**FIXED, "apply_rope_fusion": False}, hidden_is_heads=False),
    # Sliding-window hybrids (``layer_types``, ``sliding_window``): their windows make the KV
    # layout's (``windows``), one KV cache group per window, unless the job turns groups off.
    "gemma3": Family("Gemma3TextConfig", FIXED, hidden_is_heads=False, sliding=True, full_every=6),
    # One expert: with several, the library's inference MoE (GptOssExperts, eval) is not per token:
    # its routing_weights.transpose([0, 1]) is a no-op, so the reshape to [experts, batch, tokens]
    # weights each expert's output by another (token, expert) pair's weight, and a token's output
    # depends on the other tokens of its forward. No cache can equal that.
    "gpt_oss": Family("GptOssConfig", {**FIXED, "num_local_experts": 1, "num_experts_per_tok": 1},
                      hidden_is_heads=False, sliding=True, full_every=2),
}
# fastkv's default window for the sliding families (the model's own comes with its config): of the
# demo's scale, so that a demo's prompts slide past it (Gemma 3's library default is 4096)
DEFAULT_SLIDING_WINDOW = 128


def settings(family: str, layout: KVLayout, options: dict[str, Any]) -> dict[str, Any]:
    """The config keyword arguments of ``family`` for ``layout`` and the runner ``options``;
    ValueError naming the setting that is unknown or disagrees with the layout."""
    fam = FAMILIES[family]
    if unknown := set(options) - set(OPTIONS):
        raise ValueError(f"unknown runner_options {sorted(unknown)} for the paddleformers runner; "
                         f"known: {list(OPTIONS)}")
    given: dict[str, Any] = {}
    if options.get("config_file"):
        path = Path(options["config_file"])
        try:
            given.update(json.loads(path.read_text()))
        except (OSError, ValueError) as exc:
            raise ValueError(f"runner_options.config_file {str(path)!r}: {exc}") from None
        if not isinstance(given, dict):
            raise ValueError(f"runner_options.config_file {str(path)!r} must hold a JSON object")
    table = options.get("config", {})
    if not isinstance(table, dict):
        raise ValueError(f"runner_options.config must be a table of {fam.config_class} settings, got {table!r}")
    given.update(table)
    kv_heads = layout.kv_heads * layout.tp_size
    q_heads = int(given.get("num_attention_heads", 2 * kv_heads))
    hidden = int(given.get("hidden_size", q_heads * layout.head_dim))
    out = {
        "vocab_size": 1024,
        "max_position_embeddings": 8192,
        "intermediate_size": 2 * hidden,
        "tie_word_embeddings": False,
        # No padding token (the embedding would zero its row, generate() would mask it out of a
        # prompt) and no EOS (fastkv's requests say when they stop): the library's generate()
        # then computes what a serving engine computes.
        "pad_token_id": None,
        "eos_token_id": None,
        **given,
        "num_attention_heads": q_heads,
        "hidden_size": hidden,
        "num_hidden_layers": int(given.get("num_hidden_layers", layout.num_layers)),
        "num_key_value_heads": int(given.get("num_key_value_heads", kv_heads)),
        "head_dim": int(given.get("head_dim") or hidden // q_heads),
    }
    for name, want, what in (("num_hidden_layers", layout.num_layers, "layers"),
                             ("num_key_value_heads", kv_heads, "kv_heads x tp"),
                             ("head_dim", layout.head_dim, "head_dim")):
        if out[name] != want:
            raise ValueError(f"model setting {name} = {out[name]} disagrees with the KV layout's {what} = {want}")
    if q_heads % kv_heads:
        raise ValueError(f"num_attention_heads {q_heads} must be a multiple of the {kv_heads} KV heads")
    if fam.hidden_is_heads and q_heads * layout.head_dim != hidden:
        raise ValueError(f"hidden_size {hidden} must be num_attention_heads x head_dim = {q_heads * layout.head_dim}")
    if out["intermediate_size"] % layout.tp_size:
        raise ValueError(f"intermediate_size {out['intermediate_size']} must split evenly over "
                         f"tp {layout.tp_size}")
    if fam.sliding:
        if "sliding_window" not in given:
            out["sliding_window"] = DEFAULT_SLIDING_WINDOW
        if given.get("layer_types") is None:
            out["layer_types"] = default_layer_types(fam, out["num_hidden_layers"])
        check_layer_types(out)
    if layout.dtype != "float32":
        raise ValueError(f"the paddleformers runner computes in float32 on this build: dtype must be 'float32', "
                         f"got {layout.dtype!r}")
    for name, value in fam.fixed.items():
        if given.get(name, value) != value:
            raise ValueError(f"model setting {name} must be {value!r} here, got {given[name]!r}")
    return {**out, **fam.fixed}


def check_layer_types(config: dict[str, Any]) -> None:
    """A hybrid's layer kinds, one per layer, and its window when a layer slides (the library
    takes a wrong length or kind without a word, and fails later or not at all)."""
    kinds = config.get("layer_types")
    if kinds is None:
        return  # the library's own pattern
    if not isinstance(kinds, list) or len(kinds) != config["num_hidden_layers"]:
        raise ValueError(f"model setting layer_types must list one kind per layer ({config['num_hidden_layers']}), "
                         f"got {kinds!r}")
    if bad := sorted(set(kinds) - {"full_attention", "sliding_attention"}):
        raise ValueError(f"model setting layer_types: unknown kinds {bad}; known: full_attention, sliding_attention")
    window = config.get("sliding_window")
    if "sliding_attention" in kinds and window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"model setting sliding_window must be a positive number of tokens, got {window!r}")


def default_layer_types(fam: Family, layers: int) -> list[str]:
    """The library's default pattern (every ``full_every``-th layer full, the others sliding),
    written out so the layout and the model read one list. A model too shallow for the pattern
    to name a full layer gets its last layer full: a hybrid, not a model with no full attention."""
    kinds = ["full_attention" if (i + 1) % fam.full_every == 0 else "sliding_attention" for i in range(layers)]
    if "full_attention" not in kinds:
        kinds[-1] = "full_attention"
    return kinds


def model_windows(family: str, layout: KVLayout, options: dict[str, Any]) -> tuple[int, ...]:
    """Per layer the model's attention window (0: full), from its settings (``settings``): what
    the KV layout's ``windows`` are when its sliding layers are cached in KV cache groups."""
    config = settings(family, layout, options)
    if not FAMILIES[family].sliding:
        return ()
    window = config["sliding_window"] or 0
    return tuple(window if k == "sliding_attention" else 0 for k in config["layer_types"])


def vocab_size(options: dict[str, Any]) -> int | None:
    """The vocab the options give (config table over config file), or None for the default."""
    table = options.get("config") if isinstance(options.get("config"), dict) else {}
    if "vocab_size" in table:
        return int(table["vocab_size"])
    if options.get("config_file"):
        try:
            doc = json.loads(Path(options["config_file"]).read_text())
        except (OSError, ValueError):
            return None  # settings() names the problem
        if isinstance(doc, dict) and "vocab_size" in doc:
            return int(doc["vocab_size"])
    return None

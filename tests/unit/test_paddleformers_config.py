"""The PaddleFormers runners' settings, per model family, checked against the KV layout before
anything imports Paddle: each disagreement is one ValueError naming the setting (and, through
the CLI, one line)."""
from __future__ import annotations

import json

import pytest

from fastkv.cli import JobConfig
from fastkv.config import KVLayout
from fastkv.engine.runners.paddleformers_config import (
    DEFAULT_SLIDING_WINDOW,
    FAMILIES,
    default_layer_types,
    model_windows,
    settings,
    vocab_size,
)
from tests.optional import require_paddleformers


def layout(tp: int = 1, **kw) -> KVLayout:
    return KVLayout(**{"num_layers": 2, "kv_heads": 2 // tp, "block_size": 4, "head_dim": 16, "dtype": "float32",
                       "tp_size": tp, **kw})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_shape_comes_from_the_layout(family):
    s = settings(family, layout(2), {})
    assert (s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"]) == (2, 2, 16)
    assert s["num_attention_heads"] == 4 and s["hidden_size"] == 64 and s["fuse_rms_norm"] is False
    assert s["pad_token_id"] is None and s["eos_token_id"] is None


@pytest.mark.parametrize("family", FAMILIES)
def test_a_config_file_under_the_config_table(family, tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": 300, "intermediate_size": 96, "rms_norm_eps": 1e-5}))
    opts = {"config_file": str(path), "config": {"vocab_size": 200}}
    s = settings(family, layout(), opts)
    assert s["vocab_size"] == 200 and s["intermediate_size"] == 96 and s["rms_norm_eps"] == 1e-5
    assert vocab_size(opts) == 200 and vocab_size({"config_file": str(path)}) == 300 and vocab_size({}) is None


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(("lay", "opts", "message"), [
    (layout(), {"config": {"head_dim": 32}}, "head_dim = 32 disagrees with the KV layout's head_dim = 16"),
    (layout(), {"config": {"num_hidden_layers": 3}}, "num_hidden_layers = 3 disagrees"),
    (layout(), {"config": {"num_key_value_heads": 4}}, "num_key_value_heads = 4 disagrees with the KV layout's "
                                                        "kv_heads x tp = 2"),
    (layout(), {"config": {"num_attention_heads": 3}}, "num_attention_heads 3 must be a multiple of the 2 KV heads"),
    (layout(2), {"config": {"intermediate_size": 99}}, "intermediate_size 99 must split evenly over tp 2"),
    (layout(dtype="bfloat16"), {}, "dtype must be 'float32'"),
    (layout(), {"config": {"fuse_rms_norm": True}}, "fuse_rms_norm must be False"),
    (layout(), {"model": "x"}, "unknown runner_options ['model']"),
    (layout(), {"config_file": "/nonexistent/config.json"}, "runner_options.config_file '/nonexistent/config.json'"),
    (layout(), {"config": "x"}, "runner_options.config must be a table of "),
])
def test_a_setting_that_disagrees_is_named(family, lay, opts, message):
    with pytest.raises(ValueError) as exc:
        settings(family, lay, opts)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_llama_hidden_size_is_its_heads_and_ernie_maps_back_by_o_proj():
    """Llama is held to hidden = heads x head_dim; ERNIE 4.5's own configs are not (0.3B: 16 heads
    of 128 over a hidden size of 1024), its o_proj maps the heads back."""
    opts = {"config": {"hidden_size": 100, "head_dim": 16}}
    with pytest.raises(ValueError, match="hidden_size 100 must be num_attention_heads x head_dim = 64"):
        settings("llama", layout(), opts)
    assert settings("ernie4_5", layout(), opts)["hidden_size"] == 100


def test_ernie_fused_rope_is_refused():
    """Its fused RoPE takes no position ids: it would rotate a decode as position 0."""
    with pytest.raises(ValueError, match="model setting apply_rope_fusion must be False here, got True"):
        settings("ernie4_5", layout(), {"config": {"apply_rope_fusion": True}})
    assert settings("ernie4_5", layout(), {})["apply_rope_fusion"] is False


@pytest.mark.parametrize("family", ["gemma3", "gpt_oss"])
@pytest.mark.parametrize(("config", "message"), [
    ({"layer_types": ["sliding_attention"]}, "layer_types must list one kind per layer \\(2\\)"),
    ({"layer_types": ["sliding_attention", "local"]}, "layer_types: unknown kinds \\['local'\\]"),
    ({"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 0},
     "sliding_window must be a positive"),
])
def test_a_hybrids_layer_kinds_are_checked(family, config, message):
    with pytest.raises(ValueError, match=f"model setting {message}"):
        settings(family, layout(), {"config": config})
    assert settings(family, layout(), {"config": {"layer_types": ["sliding_attention", "full_attention"],
                                                  "sliding_window": 6}})["sliding_window"] == 6


def test_gpt_oss_is_held_to_one_expert():
    """The library's inference MoE mixes tokens when it has several experts (paddleformers_config)."""
    assert settings("gpt_oss", layout(), {})["num_local_experts"] == 1
    with pytest.raises(ValueError, match="model setting num_local_experts must be 1 here, got 4"):
        settings("gpt_oss", layout(), {"config": {"num_local_experts": 4}})


@pytest.mark.parametrize("family", FAMILIES)
def test_the_job_is_refused_before_anything_starts(family):
    require_paddleformers()  # the CLI checks the extra is there before the shape
    runner = f"paddleformers:{family}"
    with pytest.raises(ValueError, match=f"the {runner} runner cannot run this shape: model setting "
                                         "head_dim = 64 disagrees"):
        JobConfig(runner=runner, runner_options={"config": {"head_dim": 64}}, head_dim=16)
    cfg = JobConfig(runner=runner, runner_options={"config": {"vocab_size": 300}}, demo={"vocab": 300})
    assert cfg.vocab() == 300


@pytest.mark.parametrize("family", FAMILIES)
def test_an_unknown_runner_option_is_named_as_a_table_error(family):
    from fastkv.cli import TableError

    with pytest.raises(TableError, match=rf"unknown runner_options \['modle'\] for the paddleformers:{family} runner"):
        JobConfig(runner=f"paddleformers:{family}", runner_options={"modle": 1})


@pytest.mark.parametrize("family", [f for f, fam in FAMILIES.items() if fam.sliding])
@pytest.mark.parametrize("layers", [2, 4, 6, 12, 13])
def test_the_default_layer_kinds_are_the_librarys_pattern(family, layers):
    """Written out so the layout and the model read one list: the library's own default, but a
    model too shallow for the pattern to name a full layer gets its last one full."""
    require_paddleformers()
    import paddleformers.transformers as pf

    want = list(getattr(pf, FAMILIES[family].config_class)(num_hidden_layers=layers).layer_types)
    if "full_attention" not in want:
        want[-1] = "full_attention"
    lay = KVLayout(num_layers=layers, kv_heads=2, block_size=4, head_dim=16, dtype="float32")
    assert settings(family, lay, {})["layer_types"] == want
    assert default_layer_types(FAMILIES[family], layers) == want


def test_the_models_windows_come_from_its_config():
    assert model_windows("gpt_oss", layout(), {}) == (DEFAULT_SLIDING_WINDOW, 0)
    assert model_windows("gemma3", layout(), {"config": {"sliding_window": 6}}) == (6, 0)
    assert model_windows("gemma3", layout(), {"config": {"layer_types": ["full_attention"] * 2}}) == (0, 0)
    assert model_windows("llama", layout(), {}) == ()

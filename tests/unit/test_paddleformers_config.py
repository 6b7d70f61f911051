"""The PaddleFormers runner's settings, checked against the KV layout before anything imports
Paddle: each disagreement is one ValueError naming the setting (and, through the CLI, one line)."""
from __future__ import annotations

import json

import pytest

from fastkv.cli import JobConfig
from fastkv.config import KVLayout
from fastkv.engine.runners.paddleformers_config import llama_settings, vocab_size
from tests.optional import require_paddleformers


def layout(tp: int = 1, **kw) -> KVLayout:
    return KVLayout(**{"num_layers": 2, "kv_heads": 2 // tp, "block_size": 4, "head_dim": 16, "dtype": "float32",
                       "tp_size": tp, **kw})


def test_the_shape_comes_from_the_layout():
    s = llama_settings(layout(2), {})
    assert (s["num_hidden_layers"], s["num_key_value_heads"], s["head_dim"]) == (2, 2, 16)
    assert s["num_attention_heads"] == 4 and s["hidden_size"] == 64 and s["fuse_rms_norm"] is False
    assert s["pad_token_id"] is None and s["eos_token_id"] is None


def test_a_config_file_under_the_config_table(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"vocab_size": 300, "intermediate_size": 96, "rms_norm_eps": 1e-5}))
    opts = {"config_file": str(path), "config": {"vocab_size": 200}}
    s = llama_settings(layout(), opts)
    assert s["vocab_size"] == 200 and s["intermediate_size"] == 96 and s["rms_norm_eps"] == 1e-5
    assert vocab_size(opts) == 200 and vocab_size({"config_file": str(path)}) == 300 and vocab_size({}) is None


@pytest.mark.parametrize(("lay", "opts", "message"), [
    (layout(), {"config": {"head_dim": 32}}, "head_dim = 32 disagrees with the KV layout's head_dim = 16"),
    (layout(), {"config": {"num_hidden_layers": 3}}, "num_hidden_layers = 3 disagrees"),
    (layout(), {"config": {"num_key_value_heads": 4}}, "num_key_value_heads = 4 disagrees with the KV layout's "
                                                        "kv_heads x tp = 2"),
    (layout(), {"config": {"num_attention_heads": 3}}, "num_attention_heads 3 must be a multiple of the 2 KV heads"),
    (layout(), {"config": {"hidden_size": 100, "head_dim": 16}},
     "hidden_size 100 must be num_attention_heads x head_dim = 64"),
    (layout(2), {"config": {"intermediate_size": 99}}, "intermediate_size 99 must split evenly over tp 2"),
    (layout(dtype="bfloat16"), {}, "dtype must be 'float32'"),
    (layout(), {"config": {"fuse_rms_norm": True}}, "fuse_rms_norm must be False"),
    (layout(), {"model": "x"}, "unknown runner_options ['model']"),
    (layout(), {"config_file": "/nonexistent/config.json"}, "runner_options.config_file '/nonexistent/config.json'"),
])
def test_a_setting_that_disagrees_is_named(lay, opts, message):
    with pytest.raises(ValueError) as exc:
        llama_settings(lay, opts)
    assert message in str(exc.value)


def test_the_job_is_refused_before_anything_starts():
    require_paddleformers()  # the CLI checks the extra is there before the shape
    with pytest.raises(ValueError, match="the paddleformers:llama runner cannot run this shape: model setting "
                                         "head_dim = 64 disagrees"):
        JobConfig(runner="paddleformers:llama", runner_options={"config": {"head_dim": 64}}, head_dim=16)
    cfg = JobConfig(runner="paddleformers:llama", runner_options={"config": {"vocab_size": 300}})
    assert cfg.vocab() == 300


def test_an_unknown_runner_option_is_named_as_a_table_error():
    from fastkv.cli import TableError

    with pytest.raises(TableError, match=r"unknown runner_options \['modle'\] for the paddleformers:llama runner"):
        JobConfig(runner="paddleformers:llama", runner_options={"modle": 1})

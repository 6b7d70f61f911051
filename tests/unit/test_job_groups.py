"""A supervisor job's KV cache groups: the layout's windows from the model (the synthetic
runner's ``layer_windows``, a PaddleFormers model's config), the defaults that follow (no host
tier, recompute; a host tier when preemption offloads), ``auto`` falling back to full caching with
its reason when the run asks for what groups do not run with yet, ``on`` refusing it in one line,
and the device tier's split."""
from __future__ import annotations

import pytest

from fastkv.cli import JobConfig
from fastkv.cli.args import _flags, build_parser
from fastkv.cli.job import DEFAULT_HOST_BLOCKS
from fastkv.config import cdiv
from tests.optional import require_paddleformers


def job(**kw) -> JobConfig:
    return JobConfig(**{"quick": True, **kw})


def test_layer_windows_repeat_over_the_layers_and_groups_run_without_copies():
    cfg = job(layer_windows="64,0", layers=6)
    lay = cfg.layout()
    assert lay.windows == (64, 0) * 3 and [g.window for g in lay.groups] == [64, 0]
    assert (cfg.host_blocks, cfg.preemption, cfg.storage_url(__import__("pathlib").Path("/o"))) == (0, "recompute", "")
    assert cfg.groups_note == ""
    spec = cfg.to_spec("r", __import__("pathlib").Path("/o"))
    assert spec.layout.windows == lay.windows and spec.group_blocks == cfg.group_blocks


def test_the_device_tier_is_split_by_bytes_in_the_proportion_requests_need():
    """--device-blocks is the bytes of that many blocks of every layer; the sliding group gets
    its window's bound per request (and a prefill chunk's), the full group the rest."""
    cfg = job(layer_windows="64,0", device_blocks=100)
    lay = cfg.layout()
    sliding, full = lay.groups
    sizes = [lay.group_block_bytes(g) for g in lay.groups]
    used = sum(n * s for n, s in zip(cfg.group_blocks, sizes, strict=True))
    assert 100 * lay.block_bytes - sizes[1] < used <= 100 * lay.block_bytes
    longest_prompt = max(len(r["prompt"]) for r in cfg.requests())
    assert cfg.group_blocks[0] >= sliding.max_blocks(lay.block_size, longest_prompt)  # a prefill fits
    # the full group holds more blocks than the all-full tier of the same bytes would
    assert cfg.group_blocks[1] > 100
    # twice the bytes: both groups grow
    big = job(layer_windows="64,0", device_blocks=200)
    assert all(b > a for a, b in zip(cfg.group_blocks, big.group_blocks, strict=True))


@pytest.mark.parametrize(("kw", "flag"), [({"storage": "lmdb:///tmp/s"}, "--storage"),
                                          ({"preemption": "storage"}, "--preemption storage"),
                                          ({"update_weights_at": "4:v2"}, "--update-weights-at"),
                                          ({"kv_events_endpoint": "ipc:///tmp/e"}, "--kv-events-schema llm-d")])
def test_auto_caches_in_full_when_the_run_asks_for_what_groups_lack_and_on_refuses(kw, flag):
    cfg = job(layer_windows="64,0", **kw)
    assert cfg.layout().windows == () and cfg.group_blocks == ()
    assert cfg.groups_note.startswith(f"KV cache groups off: {flag}"), cfg.groups_note
    if "host_blocks" not in kw and "preemption" not in kw:
        assert cfg.host_blocks == DEFAULT_HOST_BLOCKS  # every layer in full: today's defaults
    with pytest.raises(ValueError, match=f"^{flag}.*: not supported with KV cache groups yet; --kv-cache-groups "
                                         "off runs it with every layer cached in full$"):
        job(layer_windows="64,0", kv_cache_groups="on", **kw)


@pytest.mark.parametrize("kw", [{"host_blocks": 256}, {"preemption": "offload"}, {"preemption": "auto"},
                                {"host_blocks": 300, "preemption": "offload", "kv_cache_groups": "on"}])
def test_a_host_tier_and_offload_keep_the_groups_with_a_host_segment_per_group(kw):
    cfg = job(layer_windows="64,0", **kw)
    assert cfg.layout().windows and cfg.groups_note == ""
    assert cfg.host_blocks == kw.get("host_blocks", DEFAULT_HOST_BLOCKS if "preemption" in kw else 256)
    spec = cfg.to_spec("r", __import__("pathlib").Path("/o"))
    lay, host = spec.layout, spec.host_group_blocks()
    assert len(host) == 2 and min(host) > 0
    # the bytes of host_blocks blocks of every layer, in the device tier's proportion
    used = sum(n * lay.group_block_bytes(g) for n, g in zip(host, lay.groups, strict=True))
    assert 0.9 * cfg.host_blocks * lay.block_bytes <= used <= cfg.host_blocks * lay.block_bytes
    assert host[0] * spec.group_blocks[1] <= host[1] * spec.group_blocks[0] + spec.group_blocks[1]


def test_kv_events_in_vllms_schema_keep_the_groups():
    cfg = job(layer_windows="64,0", kv_events_endpoint="ipc:///tmp/e", kv_events_schema="vllm")
    assert cfg.layout().windows and cfg.to_spec("r", __import__("pathlib").Path("/o")).events_config() is not None


def test_off_caches_every_layer_in_full_with_todays_defaults():
    cfg = job(layer_windows="64,0", kv_cache_groups="off")
    assert cfg.layout().windows == () and cfg.group_blocks == ()
    assert (cfg.host_blocks, cfg.preemption) == (DEFAULT_HOST_BLOCKS, "offload")
    assert "every layer cached in full" in cfg.groups_note
    plain = job()
    assert (plain.host_blocks, plain.preemption, plain.groups_note, plain.group_blocks) == (1024, "offload", "", ())


@pytest.mark.parametrize(("kw", "message"), [
    ({"layer_windows": "a"}, "setting 'layer_windows' must be comma-separated windows >= 0"),
    ({"layer_windows": "64,-1"}, "setting 'layer_windows' must be comma-separated windows >= 0"),
    ({"layer_windows": "64,0,0"}, "setting 'layer_windows' '64,0,0' names 3 layers, which do not repeat evenly"),
    ({"layer_windows": "4", "runner": "tiny"},
     "setting 'layer_windows' is the synthetic runner's; the tiny runner has no"),
    ({"kv_cache_groups": "on"}, "setting 'kv_cache_groups' 'on' needs sliding-window layers"),
    ({"kv_cache_groups": "maybe"}, "setting 'kv_cache_groups' must be one of"),
    ({"layer_windows": "64,0", "device_blocks": 2}, "setting 'device_blocks' 2: a device tier of"),
])
def test_bad_values_are_one_line(kw, message):
    with pytest.raises(ValueError, match=f"^{message}") as err:
        job(**kw)
    assert "\n" not in str(err.value)


def test_the_flags_name_themselves_in_errors():
    args = build_parser().parse_args(["--kv-cache-groups", "off", "--layer-windows", "64,0"])
    assert JobConfig.from_sources(None, _flags(args)).layout().windows == ()
    with pytest.raises(ValueError, match="^--layer-windows must be comma-separated"):
        JobConfig.from_sources(None, {"layer_windows": "x"})


@pytest.mark.parametrize(("family", "windows"), [("gpt_oss", (128, 0, 128, 0)), ("gemma3", (128, 128, 128, 0))])
def test_a_paddleformers_hybrid_caches_its_models_windows_by_default(family, windows):
    require_paddleformers()
    cfg = job(runner=f"paddleformers:{family}", head_dim=16)
    assert cfg.layout().windows == windows and len(cfg.group_blocks) == 2
    assert (cfg.host_blocks, cfg.preemption) == (0, "recompute")
    # the model's own window and kinds, from its config
    own = job(runner=f"paddleformers:{family}", head_dim=16, runner_options={"config": {
        "sliding_window": 32, "layer_types": ["full_attention"] + ["sliding_attention"] * 3}})
    assert own.layout().windows == (0, 32, 32, 32)
    bound = cdiv(32, 16) + 1
    assert own.group_blocks[[g.window for g in own.layout().groups].index(32)] >= bound
    with pytest.raises(ValueError, match="^setting 'layer_windows' is the synthetic runner's; the "
                                         f"paddleformers:{family} runner's windows come from its model config"):
        job(runner=f"paddleformers:{family}", head_dim=16, layer_windows="8,0")

import numpy as np
import pytest

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.config import KVLayout


def test_layout_sizes():
    layout = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
    assert layout.page_bytes == 8 * 64 * 128 * 2
    assert layout.block_bytes == 8 * 2 * layout.page_bytes
    assert layout.host_shape(3) == (3, 8, 2, 8, 64, 128)
    assert layout.device_shape(5) == (5, 8, 64, 128)
    assert layout.numpy_dtype == np.uint16


@pytest.mark.parametrize("field,value", [("num_layers", 0), ("kv_heads", -1), ("block_size", 1.5), ("head_dim", True)])
def test_layout_rejects_bad_sizes(field, value):
    kwargs = dict(num_layers=2, kv_heads=2, block_size=16, head_dim=64)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        KVLayout(**kwargs)


def test_layout_rejects_unknown_dtype():
    with pytest.raises(ValueError, match="dtype"):
        KVLayout(2, 2, 16, 64, dtype="float64")


def test_default_layout_description_is_unchanged():
    """Keys and stores of today's layouts stay valid: a quantized layout only adds to the description."""
    layout = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16", tp_size=2)
    assert layout.describe() == "layers=8;kv_heads=8;block=64;head_dim=128;dtype=bfloat16;tp=2"
    assert layout.kv_cache_dtype == "bfloat16" and [p.name for p in layout.parts] == ["k", "v"]


@pytest.mark.parametrize("quant", ["fp8_e4m3", "int8"])
def test_quantized_layout_packs_scales_beside_values(quant):
    bf16 = KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16")
    layout = KVLayout.of(quant, num_layers=8, kv_heads=8, block_size=64, head_dim=128)
    assert layout.dtype == "uint8" and layout.quant == quant and layout.kv_cache_dtype == quant
    assert layout.device_shape(5) == (5, 8, 64, 132) and layout.host_shape(3) == (3, 8, 2, 8, 64, 132)
    assert layout.page_bytes == 8 * 64 * (128 + 4)
    assert layout.bytes_per_token == 2 * 8 * 8 * (128 + 4) == bf16.bytes_per_token * 132 // 256
    assert {p.name: (p.page, p.dtype, p.count, p.offset) for p in layout.parts} == {
        "k": (0, quant, 128, 0), "k_scale": (0, "float32", 1, 128),
        "v": (1, quant, 128, 0), "v_scale": (1, "float32", 1, 128)}
    assert layout.describe() != KVLayout.of("int8" if quant == "fp8_e4m3" else "fp8_e4m3", num_layers=8, kv_heads=8,
                                            block_size=64, head_dim=128).describe()
    assert f"quant={quant}" in layout.describe()


def test_quantized_layout_rejects_bad_fields():
    with pytest.raises(ValueError, match="quant must be"):
        KVLayout(2, 2, 16, 64, dtype="uint8", quant="fp4")
    with pytest.raises(ValueError, match="dtype must be 'uint8'"):
        KVLayout(2, 2, 16, 64, dtype="bfloat16", quant="int8")


def test_mla_layout_holds_one_latent_page_per_layer():
    """DeepSeek V3's latent: 512 + 64 rope dims, one page per layer, the same at every tp."""
    dense = KVLayout(num_layers=4, kv_heads=1, block_size=64, head_dim=576, dtype="bfloat16", tp_size=2)
    mla = KVLayout(num_layers=4, kv_heads=1, block_size=64, head_dim=576, dtype="bfloat16", tp_size=2, mla=True)
    assert [p.name for p in mla.parts] == ["latent"] and mla.kv_pages == 1
    assert mla.host_shape(3) == (3, 4, 1, 1, 64, 576)
    assert mla.device_shape(3) == dense.device_shape(3)
    assert mla.block_bytes == 4 * 64 * 576 * 2 == dense.block_bytes // 2
    assert mla.bytes_per_token == 4 * 576 * 2
    assert mla.describe() == dense.describe() + ";mla=latent"


@pytest.mark.parametrize("fields,fragment", [
    (dict(kv_heads=2), "kv_heads must be 1"),
    (dict(dtype="uint8", quant="int8"), "quantized MLA latent is not supported"),
    (dict(mla=1), "mla must be a bool"),
])
def test_mla_layout_rejects_bad_fields(fields, fragment):
    base = dict(num_layers=2, kv_heads=1, block_size=4, head_dim=8, dtype="float32", mla=True)
    with pytest.raises(ValueError, match=fragment):
        KVLayout(**{**base, **fields})


def test_plan_validates_lengths():
    plan = CopyPlan(1, CopyKind.SWAP_OUT, [1, 2], [3, 4])
    assert plan.src.dtype == np.int32 and plan.num_blocks == 2
    with pytest.raises(ValueError, match="as many src as dst"):
        CopyPlan(2, CopyKind.SWAP_IN, [1, 2], [3])
    with pytest.raises(ValueError, match="one key per"):
        CopyPlan(3, CopyKind.STORE, [1, 2], keys=(b"k",))


def test_all_full_layout_is_todays():
    """No windows, or all zeros, is today's layout: the same describe(), hence the same keys."""
    plain = KVLayout(4, 2, 16, 64)
    assert plain.describe() == "layers=4;kv_heads=2;block=16;head_dim=64;dtype=bfloat16;tp=1"
    zeros = KVLayout(4, 2, 16, 64, windows=(0, 0, 0, 0))
    assert zeros == plain and zeros.describe() == plain.describe() and not zeros.is_hybrid
    assert plain.groups == ((0, (0, 1, 2, 3)),)


def test_hybrid_layout_groups_and_describe():
    gpt_oss = KVLayout(24, 8, 16, 64, windows=(128, 0) * 12)
    assert [(g.kind, g.window, g.layers) for g in gpt_oss.groups] == [
        ("sliding_window", 128, tuple(range(0, 24, 2))), ("full_attention", 0, tuple(range(1, 24, 2)))]
    assert gpt_oss.describe().endswith(";windows=(128,0)x12")
    gemma = KVLayout(6, 1, 16, 64, windows=[512] * 5 + [0])  # a list (JSON) is the tuple
    assert gemma.windows == (512,) * 5 + (0,)
    assert gemma.describe().endswith(";windows=(512,512,512,512,512,0)x1")
    assert len({KVLayout(4, 2, 16, 64, windows=w).describe() for w in [(), (8, 0, 8, 0), (16, 0, 16, 0),
                                                                       (0, 8, 0, 8)]}) == 4
    assert gpt_oss.group_block_bytes(gpt_oss.groups[0]) * 2 == gpt_oss.block_bytes


@pytest.mark.parametrize("windows,match", [((8, 0), "each of the 4 layers"), ((8, 0, -1, 0), "ints >= 0"),
                                           ((8, 0, True, 0), "ints >= 0")])
def test_layout_rejects_bad_windows(windows, match):
    with pytest.raises(ValueError, match=match):
        KVLayout(4, 2, 16, 64, windows=windows)


@pytest.mark.parametrize("window,bs", [(1, 4), (4, 4), (5, 4), (7, 3), (128, 16), (16, 16)])
def test_sliding_group_bounds_hold_what_a_query_reads(window, bs):
    """Between steps a sliding group holds the blocks from ``first_needed`` to the one being
    written: every position the next query reads, never more than ceil(w / bs) + 1 blocks."""
    g = KVLayout(2, 1, bs, 8, windows=(window, 0)).groups[0]
    for n in range(0, 6 * window + 3 * bs):
        first = g.first_needed(n, bs)
        reads = range(max(0, n - window + 1), n + 1)
        assert first * bs <= reads[0] < (first + 1) * bs or n - window + 1 <= 0 and first == 0
        assert n // bs - first + 1 <= -(-window // bs) + 1 == g.max_blocks(bs)
        assert g.blocks_for(n, bs) == -(-n // bs) - first <= g.max_blocks(bs)


def test_hybrid_layout_survives_the_run_specs_json():
    import dataclasses
    import json

    layout = KVLayout(4, 2, 16, 64, windows=(8, 0, 8, 0))
    back = KVLayout(**json.loads(json.dumps(dataclasses.asdict(layout))))
    assert back == layout and back.describe() == layout.describe() and back.groups == layout.groups
def test_a_run_spec_with_an_mla_layout_needs_the_tiny_runner():
    from fastkv.run import RunSpec

    layout = KVLayout(num_layers=2, kv_heads=1, block_size=4, head_dim=16, dtype="float32", mla=True)
    with pytest.raises(ValueError, match="RunSpec: an MLA layout needs runner 'tiny'.*got 'synthetic'"):
        RunSpec("r", layout, num_device_blocks=8, num_host_blocks=8)
    spec = RunSpec("r", layout, num_device_blocks=8, num_host_blocks=8, runner="tiny")
    assert RunSpec.from_json(spec.to_json()).layout == layout

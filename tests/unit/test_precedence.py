"""flag > config file > default, for every setting of the README's FastDeploy table, whichever
of a setting's names each layer uses; two names of one setting in one layer are an error."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from fastkv.cli import JobConfig, _flags, build_parser

README = Path(__file__).resolve().parents[2] / "README.md"


def flags(*argv: str) -> dict:
    return _flags(build_parser().parse_args(list(argv)))


def readme_table() -> list[tuple[str, str]]:
    """(FastDeploy setting, fastkv setting) of each row of the README's table."""
    text = README.read_text().split("### Settings for FastDeploy users", 1)[1]
    rows = re.findall(r"^\| (.+?) \| (.+?) \| .+ \|$", text, re.M)
    return [(fd, fk) for fd, fk in rows if not set(fd) <= {"-", "|"} and fd != "FastDeploy setting"]


def _name(cell: str) -> str:
    found = re.findall(r"`(\w+)`", cell)
    return found[0] if found else ""


# README row's setting -> (config file, flags, what the job must hold): the flag must win.
CASES = {
    "swap_space": ('swap_space = 0.01\n', ["--host-blocks", "200"], {"host_blocks": 200}),
    "num_cpu_blocks": ('swap_space = 0.01\n', ["--num-cpu-blocks", "200"], {"host_blocks": 200}),
    "kvcache_storage_backend": ('kvcache_storage_backend = "lmdb:///tmp/fkv-x"\n', ["--storage", "none"],
                                {"storage": "none"}),
    "enable_prefix_caching": ("enable_prefix_caching = false\n", ["--enable-prefix-caching"],
                              {"enable_prefix_caching": True}),
    "block_size": ("block_size = 32\n", ["--block-size", "8"], {"block_size": 8}),
    "free_memory_on_update": ("free_memory_on_update = false\n", ["--free-memory-on-update"],
                              {"free_memory_on_update": True}),
    "device_ids": ('tp = 2\ndevice_ids = "1,0"\n', ["--device-ids", "0,1"], {"device_ids": "0,1"}),
    "kv_cache_quant_type": ('kv_cache_quant_type = "int8"\n', ["--kv-cache-dtype", "fp8_e4m3"],
                            {"kv_cache_dtype": "fp8_e4m3"}),
}


def test_every_row_of_the_readme_table_has_a_case():
    rows = readme_table()
    assert len(rows) >= 7, rows
    names = set()
    for fd, fk in rows:
        fd_name, fk_name = _name(fd), _name(fk)
        names.add(fd_name if fd_name in CASES else fk_name)
    assert names == set(CASES), f"rows without a case: {names - set(CASES)}"


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_flag_overrides_the_config_file(tmp_path, name):
    text, argv, expect = CASES[name]
    path = tmp_path / "job.toml"
    path.write_text(text)
    cfg = JobConfig.from_sources(path, flags(*argv))
    assert {k: getattr(cfg, k) for k in expect} == expect
    assert any(argv[0] in note and "overrides" in note for note in cfg.overridden), cfg.overridden


def test_the_file_overrides_the_default_and_says_nothing(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text("num_cpu_blocks = 77\n")
    cfg = JobConfig.from_sources(path, flags())
    assert cfg.host_blocks == 77 and cfg.overridden == []
    cfg = JobConfig.from_sources(path, flags("--num-cpu-blocks", "77"))  # the same value: nothing to say
    assert cfg.host_blocks == 77 and cfg.overridden == []


def test_a_flag_overrides_the_file_under_its_other_name(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('host_blocks = 200\nstorage = "none"\n')
    cfg = JobConfig.from_sources(path, flags("--swap-space", "0.5", "--kvcache-storage-backend", "lmdb:///tmp/y"))
    assert cfg.host_blocks == 2**29 // cfg.layout().block_bytes and cfg.storage == "lmdb:///tmp/y"
    assert len(cfg.overridden) == 2


@pytest.mark.parametrize(("text", "argv", "both"), [
    ("", ["--swap-space", "0.01", "--host-blocks", "200"], ("--host-blocks", "--swap-space")),
    ("", ["--num-cpu-blocks", "9", "--host-blocks", "200"], ("--host-blocks", "--num-cpu-blocks")),
    ("swap_space = 0.01\nnum_cpu_blocks = 9\n", [], ("swap_space", "num_cpu_blocks")),
    ('storage = "none"\nkvcache_storage_backend = "lmdb:///tmp/z"\n', [], ("storage", "kvcache_storage_backend")),
])
def test_two_names_of_one_setting_in_one_layer_are_an_error_naming_both(tmp_path, text, argv, both):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises(ValueError, match="given twice") as exc:
        JobConfig.from_sources(path, flags(*argv))
    assert all(name in str(exc.value) for name in both), exc.value


@pytest.mark.parametrize(("text", "argv", "want", "bytes_per_token"), [
    ("", [], "float32", 2 * 4 * 2 * 64 * 4),
    ("", ["--kv-cache-dtype", "bfloat16"], "bfloat16", 2 * 4 * 2 * 64 * 2),
    ('kv_cache_quant_type = "fp8"\n', [], "fp8_e4m3", 2 * 4 * 2 * (64 + 4)),
    ('kv_cache_dtype = "int8"\n', [], "int8", 2 * 4 * 2 * (64 + 4)),
    ('kv_cache_dtype = "int8"\n', ["--kv-cache-dtype", "auto"], "float32", 2 * 4 * 2 * 64 * 4),
])
def test_the_kv_cache_dtype_sets_the_layout_and_its_bytes(tmp_path, text, argv, want, bytes_per_token):
    path = tmp_path / "job.toml"
    path.write_text(text)
    cfg = JobConfig.from_sources(path, flags(*argv))
    layout = cfg.layout()
    assert layout.kv_cache_dtype == want and layout.bytes_per_token == bytes_per_token
    assert cfg.to_spec("r", tmp_path).layout == layout
    # --swap-space sizes the host tier by the layout's real block bytes
    cfg = JobConfig.from_sources(path, flags(*argv, "--swap-space", "0.5"))
    assert cfg.host_blocks == 2**29 // (bytes_per_token * cfg.block_size)


def test_kv_layout_mla_gives_one_latent_per_token_at_every_tp(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('kv_layout = "mla"\nrunner = "tiny"\n')
    for tp in (1, 2):
        cfg = JobConfig.from_sources(path, flags("--kv-heads", "1", "--head-dim", "32", "--tp", str(tp)))
        layout = cfg.layout()
        assert layout.mla and layout.kv_heads == 1 and layout.bytes_per_token == 4 * 32 * 4  # layers x latent x f32
        assert cfg.to_spec("r", tmp_path).layout == layout
    assert not JobConfig.from_sources(None, flags()).layout().mla


@pytest.mark.parametrize(("argv", "match"), [
    (["--kv-layout", "gqa"], "argument --kv-layout: invalid choice: 'gqa'"),
    (["--kv-layout", "mla", "--runner", "tiny"], "--kv-layout 'mla' caches one latent per token: set "
                                                 "'kv_heads' to 1, got 2"),
    (["--kv-layout", "mla", "--kv-heads", "1"], "--kv-layout 'mla' needs runner 'tiny'"),
    (["--kv-layout", "mla", "--kv-heads", "1", "--runner", "tiny", "--kv-cache-dtype", "int8"],
     "--kv-layout 'mla' takes no quantized KV"),
    (["--kv-layout", "mla", "--kv-heads", "1", "--runner", "tiny", "--head-dim", "12"],
     "the tiny runner cannot run this shape: the MLA latent needs head_dim a multiple of 8"),
])
def test_bad_kv_layouts_are_one_line_errors(capsys, argv, match):
    with pytest.raises((ValueError, SystemExit)) as exc:
        JobConfig.from_sources(None, flags(*argv))
    said = capsys.readouterr().err.strip().splitlines()[-1:] if exc.type is SystemExit else [str(exc.value)]
    assert len(said) == 1 and "\n" not in said[0] and match in said[0], said


@pytest.mark.parametrize(("text", "argv", "match"), [
    ("", ["--kv-cache-dtype", "fp4"], "argument --kv-cache-dtype: invalid choice: 'fp4'"),
    ('kv_cache_quant_type = "int4_zp"\n', [], "setting 'kv_cache_quant_type' must be one of"),
    ('kv_cache_dtype = "fp8"\n', [], "setting 'kv_cache_dtype' must be one of"),
    ('kv_cache_dtype = "int8"\nkv_cache_quant_type = "int8"\n', [], "given twice, as kv_cache_dtype"),
    ("", ["--dtype", "bfloat16", "--kv-cache-dtype", "int8"], "as 'dtype' or as 'kv_cache_dtype', not both"),
    ("", ["--runner", "tiny", "--kv-cache-dtype", "bfloat16"], "the tiny runner needs KV dtype 'float32'"),
])
def test_a_bad_kv_cache_dtype_is_one_clear_line(tmp_path, capsys, text, argv, match):
    path = tmp_path / "job.toml"
    path.write_text(text)
    with pytest.raises((ValueError, SystemExit)) as exc:
        JobConfig.from_sources(path, flags(*argv))
    said = capsys.readouterr().err.strip().splitlines()[-1:] if exc.type is SystemExit else [str(exc.value)]
    assert len(said) == 1 and "\n" not in said[0] and match in said[0], said


def test_help_states_the_rule():
    assert "flag > config file > default" in " ".join(build_parser().format_help().split())
    assert "flag > config file > default" in README.read_text()


def test_the_hit_and_prefetch_policies_follow_the_rule(tmp_path):
    path = tmp_path / "job.toml"
    path.write_text('hit_policy = "recompute"\nprefetch_policy = "wait_complete"\n'
                    "prefetch_timeout_per_1k_tokens_s = 0.5\n")
    cfg = JobConfig.from_sources(path, flags("--hit-policy", "load", "--prefetch-timeout-per-1k-tokens-s", "2"))
    assert (cfg.hit_policy, cfg.prefetch_policy, cfg.prefetch_timeout_per_1k_tokens_s) == ("load", "wait_complete", 2.0)
    spec = cfg.to_spec("r", tmp_path)
    assert (spec.hit_policy, spec.prefetch_policy, spec.prefetch_timeout_per_1k_tokens_s) == (
        "load", "wait_complete", 2.0)
    default = JobConfig.from_sources(None, flags())
    assert (default.hit_policy, default.prefetch_policy, default.storage_lookup_timeout_s) == ("auto", "timeout", 0.2)


def test_a_bad_value_is_named_as_the_user_gave_it(tmp_path):
    """A flag's bad value names the flag; the same value from the config file names its setting."""
    with pytest.raises(ValueError) as exc:
        JobConfig.from_sources(None, flags("--storage-backlog-blocks", "-3"))
    assert str(exc.value) == "--storage-backlog-blocks must be >= 0, got -3"
    path = tmp_path / "job.toml"
    path.write_text("storage_backlog_blocks = -3\n")
    with pytest.raises(ValueError) as exc:
        JobConfig.from_sources(path, flags())
    assert "setting 'storage_backlog_blocks' must be >= 0, got -3" in str(exc.value)
    assert "--storage-backlog-blocks" not in str(exc.value)

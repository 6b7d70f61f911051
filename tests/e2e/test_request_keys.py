"""What a request brings besides its tokens keys its KV, through the public API: two tenants
(``cache_salt``) or two LoRA adapters with the same prompt never hit each other's KV, in any tier or
in the shared pool after a restart, while the same tenant or adapter does; two multimodal requests
with the same tokens and different item hashes share only the blocks before the first item; and a
router's ``block_hashes(..., cache_salt=, lora=, mm_items=)`` names the blocks the engine holds."""
from __future__ import annotations

import uuid

import pytest

from fastkv.config import KVLayout
from fastkv.engine import Engine, RequestRejected
from fastkv.launch import launch
from fastkv.routing import block_hashes, namespace_for
from fastkv.run import RunSpec
from tests.e2e.embed_example import WORKER, reference

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]
BS = 4
PROMPT = [(5 * j + 3) % 1000 for j in range(21)]  # 5 full blocks


def _spec(tmp_path, store: str) -> RunSpec:
    layout = KVLayout(num_layers=1, kv_heads=2, block_size=BS, head_dim=8, dtype="float32")
    # write-through: every block reaches the host tier and so the pool, for the restart to find
    return RunSpec(f"rk{uuid.uuid4().hex[:8]}", layout, 32, 64, storage_url=f"lmdb://{store}?max_bytes=64M",
                   cache_policy="write_through", storage_lookup_timeout_s=10.0,  # a loaded machine answers late
                   out_dir=str(tmp_path / uuid.uuid4().hex[:6]), heartbeat_s=0.2)


def _hits(engine: Engine, **request) -> int:
    """Prompt tokens served from any tier for one request run alone; its output checked."""
    stats = engine.cache.stats
    before = stats.device_hit_tokens + stats.host_hit_tokens + stats.storage_hit_tokens
    rid = engine.add_request(PROMPT if "prompt" not in request else request.pop("prompt"), 4,
                             request_id=uuid.uuid4().hex[:8], sampling={"seed": 2}, **request)
    (result,) = engine.run()
    assert result.id == rid and result.output == reference(PROMPT, 4, 2, 1.0)
    return stats.device_hit_tokens + stats.host_hit_tokens + stats.storage_hit_tokens - before


def _served(spec: RunSpec, body) -> None:
    with launch(spec) as run:
        run.start("worker", 0, WORKER)
        engine = Engine.attach(spec)
        try:
            engine.wait_until_ready(60)
            body(engine)
        finally:
            engine.close()


def test_tenants_and_adapters_never_share_kv_in_any_tier_or_the_pool(tmp_path):
    store = tmp_path / "pool"
    full = (len(PROMPT) - 1) // BS * BS  # a hit never covers the last prompt token

    def first(engine: Engine) -> None:
        assert _hits(engine, cache_salt="tenant-a") == 0
        assert _hits(engine, cache_salt="tenant-b") == 0  # same tokens, another tenant
        assert _hits(engine, cache_salt="tenant-a") == full
        assert _hits(engine, lora="adapter-1") == 0
        assert _hits(engine, lora="adapter-2") == 0
        assert _hits(engine, lora="adapter-1") == full
        assert _hits(engine) == 0  # no salt, no adapter: a third key space
        ns = namespace_for(engine.spec.model_id, engine.spec.weights_version, engine.spec.layout)
        held = set(engine.cache.index.stored) | {k for k in engine.cache.device.lookup}
        for who in ({"cache_salt": "tenant-a"}, {"lora": "adapter-2"}, {}):
            assert set(block_hashes(PROMPT, ns, BS, **who)) <= held, who
        assert not set(block_hashes(PROMPT, ns, BS, cache_salt="tenant-c")) & held

    _served(_spec(tmp_path, store), first)

    def restarted(engine: Engine) -> None:  # a fresh engine on the same pool: only storage can serve
        stats = engine.cache.stats
        assert _hits(engine, cache_salt="tenant-c") == 0
        assert _hits(engine, cache_salt="tenant-b") == full and stats.storage_hit_tokens == full
        assert _hits(engine, lora="adapter-3") == 0
        assert _hits(engine, lora="adapter-2") == full

    _served(_spec(tmp_path, store), restarted)


def test_multimodal_requests_share_only_the_blocks_before_their_first_item(tmp_path):
    image_a = [{"start": 9, "end": 15, "hash": "aa" * 16}]  # block 2 (tokens 8-11) is the first it touches
    image_b = [{"start": 9, "end": 15, "hash": "bb" * 16}]

    def body(engine: Engine) -> None:
        assert _hits(engine, mm_items=image_a) == 0
        assert _hits(engine, mm_items=image_b) == 2 * BS  # blocks 0 and 1
        assert _hits(engine, mm_items=image_a) == (len(PROMPT) - 1) // BS * BS
        with pytest.raises(RequestRejected, match="mm_items"):
            engine.add_request(PROMPT, 4, mm_items=[{"start": 9, "end": 99, "hash": "aa"}])
        with pytest.raises(RequestRejected, match="cache_salt"):
            engine.add_request(PROMPT, 4, cache_salt="")

    _served(_spec(tmp_path, tmp_path / "pool"), body)


@pytest.mark.parametrize("pool", ["lmdb", "redis", "mooncake"])
def test_a_workload_files_tenants_keep_to_their_own_kv_in_a_shared_pool(tmp_path, request, pool):
    """Through the engine process the supervisor runs: run A stores its tenant's KV in the pool
    (LMDB, a Redis server, a Mooncake pool); a restart serving the same prompts to another tenant
    finds none of it, the same tenant does."""
    from tests.e2e.test_engine_synthetic import run_once, workload

    url = f"lmdb://{tmp_path}/store?max_bytes=64M" if pool == "lmdb" else request.getfixturevalue(f"{pool}_url")
    if pool == "mooncake":  # the module's pool: a fresh key prefix, so no other test's blocks are found
        url += ("&" if "?" in url else "?") + f"prefix=rk{uuid.uuid4().hex[:8]}"
    wl = workload(9, 4, ["offload"])
    tenant = lambda name: [{**w, "cache_salt": name} for w in wl]  # noqa: E731
    _, a = run_once(tmp_path, "a", url, tenant("acme"), num_host_blocks=64)
    _, other = run_once(tmp_path, "b", url, tenant("globex"), num_host_blocks=64)
    _, same = run_once(tmp_path, "c", url, tenant("acme"), num_host_blocks=64)
    assert a["storage_blocks_stored"] > 0
    # every request is looked up as it arrives (all at 0 s), before this run stored anything of its own
    assert other["storage_lookup"]["keys_found"] == 0, other["storage_lookup"]
    assert same["hit_ratio"]["storage"] > 0 and same["storage_lookup"]["keys_found"] > 0, same["hit_ratio"]

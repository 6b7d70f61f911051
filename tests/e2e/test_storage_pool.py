"""The storage tier as a pool shared across restarts: a second engine on the same store finds,
by lookup at admission, what the first one wrote, loads it and serves the same tokens."""
from __future__ import annotations

import pytest

from tests.e2e.launch import Run
from tests.e2e.test_engine_synthetic import VOCAB, check_outputs, spec, workload


def run_once(tmp_path, name: str, url: str, wl: list[dict], tp: int = 1, reference: bool = True,
             **kw) -> tuple[dict, dict]:
    """One run; ``reference``: outputs must equal the synthetic reference (of weights "0")."""
    s = spec(tp, tmp_path / name, num_device_blocks=24, num_host_blocks=12, storage_url=url,
             runner_options={"verify": "all", "vocab": VOCAB}, scheduler={"max_num_batched_tokens": 48}, **kw)
    with Run(s, wl) as run:
        assert run.wait(120) == 0, "engine failed: a KV mismatch or a worker error (see stderr)"
        results, summary = run.results(), run.summary()
        codes = run.close()
    assert all(c == 0 for c in codes.values()), codes
    if reference:
        check_outputs(results, wl)
    return results, summary


@pytest.mark.slow
@pytest.mark.parametrize("tp", [1, 2])
def test_restarted_engine_hits_what_the_first_one_stored(tmp_path, tp):
    wl = workload(12, 6, ["offload"])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    _, a = run_once(tmp_path, "a", url, wl, tp)
    _, b = run_once(tmp_path, "b", url, wl, tp)
    print("hit ratios A", a["hit_ratio"], "B", b["hit_ratio"], "lookup", b.get("storage_lookup"))
    assert b["hit_ratio"]["storage"] >= a["hit_ratio"]["storage"] + 0.2, (a["hit_ratio"], b["hit_ratio"])
    lk = b["storage_lookup"]
    assert lk["keys_found"] > 0 and lk["failed"] == 0, lk
    assert b["recomputed_because_storage"] == 0 and b["corrupt_values"] == 0, b


def corrupt_every_value(store_dir) -> int:
    import lmdb

    env = lmdb.open(str(store_dir), subdir=True, max_dbs=4)
    n = 0
    try:
        with env.begin(db=env.open_db(b"blocks"), write=True) as txn:
            for k, v in list(txn.cursor()):
                flipped = bytearray(v)
                flipped[-1] ^= 0xFF  # the last payload byte: only the checksum can tell
                txn.put(k, bytes(flipped))
                n += 1
    finally:
        env.close()
    return n


@pytest.mark.slow
def test_corrupt_store_is_detected_recomputed_and_never_served(tmp_path):
    wl = workload(12, 6, ["offload"])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    run_once(tmp_path, "a", url, wl)
    assert corrupt_every_value(tmp_path / "store") > 0
    _, b = run_once(tmp_path, "b", url, wl)  # check_outputs: every token right, the runner verified every block
    assert b["corrupt_values"] > 0 and b["recomputed_because_storage"] > 0, b
    assert b["hit_ratio"]["storage"] == 0 and b["storage_lookup"]["bytes_loaded"] == 0, b


@pytest.mark.slow
def test_other_weights_on_the_same_store_get_no_hits(tmp_path):
    """Keys chain the namespace (model, weights version, dtype, layout, tp size): another
    weights version finds nothing of the first engine's, even by lookup."""
    wl = workload(12, 6, ["offload"])
    url = f"lmdb://{tmp_path}/store?max_bytes=64M"
    run_once(tmp_path, "a", url, wl)
    _, b = run_once(tmp_path, "b", url, wl, reference=False, weights_version="v2")
    assert b["storage_lookup"]["keys_asked"] > 0 and b["storage_lookup"]["keys_found"] == 0, b["storage_lookup"]
    assert b["hit_ratio"]["storage"] == 0 and b["corrupt_values"] == 0 and b["stale_hits"] == 0, b

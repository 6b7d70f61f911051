"""The Mooncake backend beyond the conformance suite: FastDeploy's settings and their
precedence, the URL, clear start errors, leases, and a pool whose holder or master dies."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fastkv.cli import JobConfig
from fastkv.storage import mooncake_config, open_store, probe_store
from fastkv.storage.local_mooncake import LocalMooncake
from fastkv.storage.local_redis import free_port

from .conftest import NS, rand_keys, random_host, require_mooncake

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def clean_env(monkeypatch):
    for name in [*mooncake_config.ENV.values(), "MOONCAKE_CONFIG_PATH"]:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


# --- settings as FastDeploy users write them (no Mooncake needed) ------------------

def test_precedence_is_table_then_file_then_env(clean_env, tmp_path):
    clean_env.setenv("MOONCAKE_MASTER_SERVER_ADDR", "10.0.0.1:1")
    clean_env.setenv("MOONCAKE_PROTOCOL", "rdma")
    clean_env.setenv("MOONCAKE_LOCAL_HOSTNAME", "10.0.0.9")
    assert mooncake_config.resolve()["master_server_addr"] == "10.0.0.1:1"
    cfg = tmp_path / "mooncake.json"
    cfg.write_text(json.dumps({"master_server_addr": "10.0.0.2:2", "protocol": "tcp", "global_segment_size": 1024}))
    clean_env.setenv("MOONCAKE_CONFIG_PATH", str(cfg))
    got = mooncake_config.resolve({"master_server_addr": "10.0.0.3:3"})
    assert got["master_server_addr"] == "10.0.0.3:3"  # table over file
    assert got["protocol"] == "tcp" and got["global_segment_size"] == "1024"  # file over env
    assert got["local_hostname"] == "10.0.0.9"  # env where neither has it
    assert got["metadata_server"] == "P2PHANDSHAKE" and got["local_buffer_size"] == "16M"  # defaults


def test_bad_settings_name_their_source(clean_env, tmp_path):
    with pytest.raises(ValueError, match="MOONCAKE_MASTER_SERVER_ADDR"):
        mooncake_config.resolve()
    with pytest.raises(ValueError, match="unknown Mooncake keys \\['master_addr'\\]"):
        mooncake_config.resolve({"master_addr": "h:1"})
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    clean_env.setenv("MOONCAKE_CONFIG_PATH", str(bad))
    with pytest.raises(ValueError, match="bad.json: cannot read it as JSON"):
        mooncake_config.resolve({"master_server_addr": "h:1"})
    clean_env.setenv("MOONCAKE_CONFIG_PATH", str(tmp_path / "missing.json"))
    with pytest.raises(ValueError, match="missing.json: no such file"):
        mooncake_config.resolve({"master_server_addr": "h:1"})


def test_url_options(clean_env):
    got = mooncake_config.from_url("mooncake://127.0.0.1:7?local_buffer_size=32M&protocol=tcp&prefix=x&backoff=2")
    assert got["master_server_addr"] == "127.0.0.1:7" and got["local_buffer_size"] == 32 << 20
    assert got["global_segment_size"] == 0 and got["prefix"] == "x" and got["backoff"] == 2.0
    for url, why in [("mooncake://127.0.0.1:7?segment=1G", "unknown option 'segment'"),
                     ("mooncake://127.0.0.1:7?protocol=udp", "protocol"),
                     ("mooncake://127.0.0.1:7?local_buffer_size=lots", "local_buffer_size"),
                     ("mooncake://127.0.0.1?protocol=tcp", "host:port"),
                     ("mooncake://local", "mooncake://local is for")]:
        with pytest.raises(ValueError, match=why):
            mooncake_config.from_url(url)


def test_fastdeploy_job_settings_become_one_url(clean_env, tmp_path):
    cfg = JobConfig(kvcache_storage_backend="mooncake", out=str(tmp_path),
                    kvcache_storage_config={"master_server_addr": "127.0.0.1:5", "protocol": "tcp"})
    assert cfg.storage.startswith("mooncake://127.0.0.1:5?")
    assert mooncake_config.from_url(cfg.storage)["protocol"] == "tcp"
    with pytest.raises(ValueError, match="kvcache_storage_config"):
        JobConfig(kvcache_storage_config={"protocol": "tcp"}, out=str(tmp_path))
    job = tmp_path / "job.toml"  # as a FastDeploy user writes it
    job.write_text('kvcache_storage_backend = "mooncake"\n[kvcache_storage_config]\n'
                   'master_server_addr = "127.0.0.1:6"\nglobal_segment_size = 1073741824\n')
    url = JobConfig.from_sources(job).storage
    assert mooncake_config.from_url(url)["global_segment_size"] == 1 << 30 and "127.0.0.1:6" in url
    job.write_text('kvcache_storage_backend = "mooncake"\n[kvcache_storage_config]\nmaster = "h:1"\n')
    with pytest.raises(ValueError, match="unknown Mooncake keys \\['master'\\]"):
        JobConfig.from_sources(job)


# --- start errors: one line, rc 2, within 5 s ---------------------------------------

def _supervisor(tmp_path, *args: str) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "fastkv", "--quick", "--no-progress", "--out", str(tmp_path / "o"),
                           *args], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True,
                          text=True, timeout=60)
    return proc, time.monotonic() - t0


@pytest.mark.mooncake
def test_unreachable_master_or_bad_key_fails_at_start_in_one_line(tmp_path):
    require_mooncake()
    port = free_port()  # nothing listens there
    proc, took = _supervisor(tmp_path, "--storage", f"mooncake://127.0.0.1:{port}?protocol=tcp")
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"127.0.0.1:{port}" in lines[0] and "not reachable" in lines[0], lines
    assert took < 5 + 3, took  # (the interpreter's and Paddle's import come on top of the 1 s probe)
    proc, _ = _supervisor(tmp_path, "--storage", f"mooncake://127.0.0.1:{port}?global_segment=1G")
    assert proc.returncode == 2 and "unknown option 'global_segment'" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


@pytest.mark.mooncake
def test_probe_answers_within_the_timeout(tmp_path):
    require_mooncake()
    t0 = time.monotonic()
    with pytest.raises(ValueError, match="not reachable within 1 s"):
        probe_store(f"mooncake://127.0.0.1:{free_port()}", 1, timeout=1.0)
    assert time.monotonic() - t0 < 5


# --- leases, dead holders and dead masters --------------------------------------------

@pytest.mark.mooncake
def test_delete_of_a_value_read_within_its_lease():
    require_mooncake()
    with LocalMooncake(segment_size=32 << 20, lease_ttl_ms=30_000) as pool:
        store = open_store(pool.url, NS)
        host, keys = random_host(4, seed=1), rand_keys(4)
        assert store.put(keys, host, range(4)) == [True] * 4
        assert store.get(keys, np.zeros_like(host), range(4)) == [True] * 4  # now leased for 30 s
        store.delete(keys[:2])
        assert store.exists(keys) == [False, False, True, True]
        assert store.stats.errors == 0
        store.close()


@pytest.mark.mooncake
def test_values_die_with_their_holder_as_counted_misses(mooncake_pool):
    store = open_store(mooncake_pool.url, NS)
    host, keys = random_host(4, seed=2), rand_keys(4)
    assert store.put(keys, host, range(4)) == [True] * 4
    mooncake_pool.kill_holder()
    out = random_host(4, seed=3)
    before = out.copy()
    assert store.get(keys, out, range(4)) == [False] * 4
    assert np.array_equal(out, before), "a lost value touched the host block"
    assert store.stats.misses == 4 and store.stats.hits == 0
    # a new holder lends new memory: the pool works again once the master drops the dead segment
    mooncake_pool.start_holder()
    deadline = time.monotonic() + 15
    while not (store.put(keys, host, range(4)) == [True] * 4 and store.get(keys, out, range(4)) == [True] * 4):
        assert time.monotonic() < deadline, "the pool did not recover after the holder came back"
        time.sleep(0.2)  # puts fail until the master drops the dead segment (its client_ttl, 2 s here)
    assert np.array_equal(out, host)
    store.close()


@pytest.mark.mooncake
def test_dead_master_is_counted_and_backed_off(mooncake_pool):
    store = open_store(mooncake_pool.url + "&backoff=30", NS)
    host, keys = random_host(4, seed=4), rand_keys(4)
    assert store.put(keys, host, range(4)) == [True] * 4
    mooncake_pool.kill_master()
    assert store.exists(keys) == [False] * 4
    assert store.stats.errors == 1
    t0 = time.monotonic()  # within the backoff nothing waits on the dead master
    assert store.put(keys, host, range(4)) == [False] * 4
    assert store.get(keys, host, range(4)) == [False] * 4
    assert time.monotonic() - t0 < 0.5 and store.stats.skipped == 2
    store.close()


@pytest.mark.mooncake
def test_supervisor_runs_on_a_local_pool_of_its_own_and_stops_it(tmp_path):
    require_mooncake()
    proc, _ = _supervisor(tmp_path, "--storage", "mooncake://local?segment_size=128M")
    assert proc.returncode == 0, proc.stderr
    start = next(line for line in proc.stderr.splitlines() if line.startswith("fastkv-supervisor: run "))
    master = start.split("storage mooncake://", 1)[1].split("?", 1)[0]
    assert master.startswith("127.0.0.1:"), start
    with pytest.raises(ConnectionError, match="not reachable"):  # the pool went with the run
        from fastkv.storage.mooncake_store import check_reachable

        check_reachable(master, 1.0)
    proc, _ = _supervisor(tmp_path, "--storage", "mooncake://local?segment=1G")
    assert proc.returncode == 2 and "unknown option 'segment'" in proc.stderr, proc.stderr


@pytest.mark.mooncake
def test_a_full_pool_refuses_puts_counted_and_serves_what_it_holds():
    """Past its room a pool refuses puts (NO_AVAILABLE_HANDLE) until its master has evicted
    (in the background, by its own policy): each refused block is counted as not stored."""
    require_mooncake()
    with LocalMooncake(segment_size=16 << 20) as pool:  # (a few MiB hold nothing: its allocator's grain)
        store = open_store(pool.url, NS)
        host = np.random.default_rng(5).integers(0, 256, size=(16, 256 << 10), dtype=np.uint8)
        batches = [rand_keys(16) for _ in range(6)]  # 24 MiB into 16 MiB
        stored = [store.put(keys, host, range(16)) for keys in batches]
        s = store.stats
        assert s.store_failed > 0 and s.errors > 0 and s.stored + s.store_failed == 6 * 16, s
        out = np.zeros_like(host)
        for keys, ok in zip(batches, stored, strict=True):
            got = store.get(keys, out, range(16))
            assert not any(g and not o for g, o in zip(got, ok, strict=True)), "a refused put was served"
            hit = [i for i, g in enumerate(got) if g]
            assert np.array_equal(out[hit], host[hit])
        assert s.hits > 0 and s.corrupt == 0 and s.hits + s.misses == 6 * 16
        store.close()


# --- a pool nothing can be written to, and the holder's metadata settings -----------------

@pytest.mark.mooncake
def test_a_pool_with_http_metadata_serves_through_its_holder():
    """The master serves metadata over HTTP, the holder takes the same setting as the engines:
    a value an engine puts lands in the holder's segment and is read back."""
    require_mooncake()
    with LocalMooncake(segment_size=64 << 20, http_metadata=True) as pool:
        assert "metadata_server=http" in pool.url
        probe_store(pool.url, 1, timeout=2.0)
        host, keys = random_host(4, 1), rand_keys(4)
        with open_store(pool.url, NS, 0, 1) as store:
            assert store.put(keys, host, [0, 1, 2, 3]) == [True] * 4
            back = np.zeros_like(host)
            assert store.get(keys, back, [0, 1, 2, 3]) == [True] * 4
            assert np.array_equal(back, host)


@pytest.mark.mooncake
def test_a_pool_nothing_can_be_written_to_fails_at_start_in_one_line(tmp_path):
    """A master with no holder, and a holder the engines cannot reach (it registered with the
    master's HTTP metadata server, the engines look for P2P handshakes): the start-up check
    writes a value, sees it fail, and the supervisor stops rc 2 in one line saying what to do."""
    require_mooncake()
    pool = LocalMooncake(segment_size=64 << 20)
    pool.start_master()
    try:
        deadline = time.monotonic() + 15  # its last log line comes before its RPC port listens
        while True:
            try:
                socket.create_connection(("127.0.0.1", pool.port), timeout=1).close()
                break
            except OSError:
                assert time.monotonic() < deadline, "mooncake_master does not listen"
                time.sleep(0.05)
        with pytest.raises(ValueError, match="cannot hold a value"):
            probe_store(pool.url, 1, timeout=2.0)
        proc, _ = _supervisor(tmp_path / "a", "--storage", pool.url)
        lines = proc.stderr.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, proc.stderr
        assert "cannot hold a value" in lines[0] and "mooncake_holder" in lines[0], lines
    finally:
        pool.stop()
    with LocalMooncake(segment_size=64 << 20, http_metadata=True) as pool:
        p2p = pool.url.replace(f"metadata_server=http%3A%2F%2F127.0.0.1%3A{pool.http_port}%2Fmetadata",
                               "metadata_server=P2PHANDSHAKE")
        assert p2p != pool.url
        with pytest.raises(ValueError, match="cannot hold a value"):
            probe_store(p2p, 1, timeout=2.0)


def test_the_holder_refuses_what_it_cannot_serve_in_one_line(clean_env):
    for args, says in ((["127.0.0.1:1", "4X"], "SEGMENT_SIZE"), (["nohost", "1G"], "MASTER must be host:port"),
                       (["127.0.0.1:1", "1G", "--protocol", "udp"], "--protocol"),
                       (["127.0.0.1:1", "1G", "--metadata-server", "etcd"], "--metadata-server")):
        proc = subprocess.run([sys.executable, "-m", "fastkv.storage.mooncake_holder", *args], capture_output=True,
                              text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=60)
        assert proc.returncode == 2 and says in proc.stderr, (args, proc.stderr)
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

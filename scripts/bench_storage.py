#!/usr/bin/env python
"""Storage-tier throughput: store (put) and load (get) MB/s of whole host blocks, per
backend, at batch sizes 1 and 64, through the same API the transfer processes call.

Each round stores ``--blocks`` fresh keys from a host array, loads them back into another
one (checked byte-identical), then deletes them outside the timed part. Rounds of the
backends interleave; the median round of each is reported. LMDB runs in a temporary
directory (removed afterwards; its reads come from the page cache, as they would for a
recently stored block); Redis is the server at
``--redis-url`` or a redis-server started here on 127.0.0.1 without persistence.

``--backends redis,redis-py`` adds the peer of fastkv's hand-written RESP path (issue 15):
the same ``RedisStore`` with its SET and GET pipelines through redis-py's own client, which
packs and parses with ``hiredis`` when it is installed (``pip install 'redis[hiredis]'``).

``mooncake`` is fastkv's Mooncake backend on a pool started here (mooncake_master and a holder
on 127.0.0.1, local_mooncake.py); ``mooncake-raw`` is Mooncake's own batched API on the same pool
with no fastkv code (``batch_put_from`` / ``batch_get_into`` of the bare blocks, registered
buffers, no header, no checksum, no staging): the ceiling fastkv's backend is measured against.
Both are in the default set where the Mooncake client is installed.

``--kv-cache-dtypes bfloat16,fp8_e4m3`` measures the layout in each KV dtype, interleaved, and
adds tokens/s (MB/s over the layout's bytes per token, scales included) and each dtype's
tokens/s against the first's at batch 64: quantized KV moves about twice the tokens at the same
bytes/s. ``--link-mbps`` holds every batch to a link's speed (as the transfer process holds its
storage I/O to the deployment's link under a cost model), so that the dtypes compare at the same
bytes/s rather than at this machine's CPU-bound page-cache speed. The JSON's keys are the first
dtype's; the others' carry their dtype (``lmdb_fp8_e4m3_put``).

The last line is the issue's JSON: {"bench": "storage", "mbps": {...}} at batch 64.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from fastkv.cli import at_least  # noqa: E402
from fastkv.config import KV_CACHE_DTYPES, KVLayout  # noqa: E402
from fastkv.storage import StorageBackend, namespace_fingerprint, open_store  # noqa: E402
from fastkv.storage.base import HEADER_BYTES, Verdict  # noqa: E402
from fastkv.storage.local_mooncake import LocalMooncake  # noqa: E402
from fastkv.storage.local_redis import LocalRedis  # noqa: E402
from fastkv.storage.mooncake_config import from_url  # noqa: E402
from fastkv.storage.mooncake_store import AVAILABLE as MOONCAKE  # noqa: E402
from fastkv.storage.redis_store import _FAILURES, RedisStore  # noqa: E402

LAYOUTS = {
    # 64-token blocks across 8 layers: 2 MiB per block (the reference block).
    "default": KVLayout(num_layers=8, kv_heads=8, block_size=64, head_dim=128, dtype="bfloat16"),
    # 64-token blocks of a smaller model: 256 KiB per block.
    "small": KVLayout(num_layers=2, kv_heads=4, block_size=64, head_dim=128, dtype="bfloat16"),
}
BATCHES = (1, 64)
BACKENDS = ("lmdb", "redis", "redis-py", "mooncake", "mooncake-raw")
DEFAULT_BACKENDS = "lmdb,redis,mooncake,mooncake-raw" if MOONCAKE else "lmdb,redis"


class RedisPyStore(RedisStore):
    """``RedisStore`` with its block SET/GET pipelines through redis-py (hiredis when installed)."""

    def _put_chunk(self, keys, blocks, ids, lo: int, hi: int, results: list[bool]) -> bool:
        try:
            pipe = self._client.pipeline(transaction=False)
            for k, b in zip(keys[lo:hi], ids[lo:hi], strict=True):
                payload = memoryview(blocks[b])
                pipe.set(self._rkey(k), self.codec.header(k, payload) + payload, ex=self.ttl)
            replies = pipe.execute(raise_on_error=False)
        except _FAILURES as e:
            self._failed("put", e)
            return False
        self._ok()
        for i, r in enumerate(replies, lo):
            results[i] = r is True
        return True

    def _get_chunk(self, keys, blocks, ids, lo: int, hi: int, results: list[bool]) -> bool:
        payload_bytes = blocks.shape[1]
        try:
            pipe = self._client.pipeline(transaction=False)
            for k in keys[lo:hi]:
                pipe.get(self._rkey(k))
            values = pipe.execute(raise_on_error=False)
        except _FAILURES as e:
            self._failed("get", e)
            return False
        self._ok()
        for i, value in enumerate(values, lo):
            if isinstance(value, bytes) and self.codec.verify(keys[i], value, payload_bytes) is Verdict.OK:
                blocks[ids[i]] = np.frombuffer(value, np.uint8, payload_bytes, HEADER_BYTES)
                results[i] = True
        return True


class MooncakeRaw:
    """Mooncake's batched API on the bare blocks, as a client with no fastkv code would call it."""

    def __init__(self, url: str, host: np.ndarray, out: np.ndarray) -> None:
        from mooncake.store import MooncakeDistributedStore

        o = from_url(url)
        self.store = MooncakeDistributedStore()
        ret = self.store.setup(o["local_hostname"], o["metadata_server"], o["global_segment_size"],
                               o["local_buffer_size"], o["protocol"], o["rdma_devices"], o["master_server_addr"])
        if ret != 0:
            raise OSError(f"Mooncake setup failed with code {ret}")
        self.size = host[0].nbytes
        for arr in (host, out):
            self.store.register_buffer(arr.ctypes.data, arr.nbytes)
        self.stats = "raw"

    def put(self, keys, host, ids):
        base = host.ctypes.data
        return [c == 0 for c in self.store.batch_put_from([k.hex() for k in keys], [base + b * self.size for b in ids],
                                                          [self.size] * len(keys))]

    def get(self, keys, out, ids):
        base = out.ctypes.data
        return [c == self.size for c in self.store.batch_get_into([k.hex() for k in keys],
                                                                  [base + b * self.size for b in ids],
                                                                  [self.size] * len(keys))]

    def delete(self, keys):
        self.store.batch_remove([k.hex() for k in keys], True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.store.close()


def _link(t0: float, nbytes: int, link_bps: float) -> None:
    """Wait out what a link of ``link_bps`` bytes/s would still take for ``nbytes`` sent from ``t0``
    (as the transfer process waits out its storage link under a cost model)."""
    if link_bps > 0 and (rest := t0 + nbytes / link_bps - time.perf_counter()) > 0:
        time.sleep(rest)


def measure(store: StorageBackend, host: np.ndarray, out: np.ndarray, batch: int, rounds: int,
            link_bps: float = 0.0) -> tuple[float, float]:
    """Median put and get MB/s over ``rounds`` rounds of ``len(host)`` fresh blocks; ``link_bps`` > 0:
    each batch takes at least its bytes' time on a link of that many bytes/s."""
    n = host.shape[0]
    total_mb = host.nbytes / 1e6
    puts, gets = [], []
    for r in range(rounds):
        keys = [os.urandom(32) for _ in range(n)]
        t0 = time.perf_counter()
        for lo in range(0, n, batch):
            tb = time.perf_counter()
            ok = store.put(keys[lo:lo + batch], host, range(lo, min(lo + batch, n)))
            if not all(ok):  # the backend could not be used (a server not there, a full disk)
                raise OSError(f"put failed: {store.stats}")
            _link(tb, host[lo:lo + batch].nbytes, link_bps)
        t1 = time.perf_counter()
        for lo in range(0, n, batch):
            tb = time.perf_counter()
            ok = store.get(keys[lo:lo + batch], out, range(lo, min(lo + batch, n)))
            if not all(ok):
                raise OSError(f"get failed: {store.stats}")
            _link(tb, out[lo:lo + batch].nbytes, link_bps)
        t2 = time.perf_counter()
        if r == 0:
            assert np.array_equal(out, host), "loaded blocks differ from the stored ones"
        store.delete(keys)
        puts.append(total_mb / (t1 - t0))
        gets.append(total_mb / (t2 - t1))
    return statistics.median(puts), statistics.median(gets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer blocks and rounds (under a minute)")
    ap.add_argument("--layout", choices=sorted(LAYOUTS), default="default")
    ap.add_argument("--blocks", type=at_least(1), help="blocks per round (default 128, quick 64)")
    ap.add_argument("--rounds", type=at_least(1), help="rounds per measurement (default 5, quick 3)")
    ap.add_argument("--redis-url", help="use this server instead of starting one")
    ap.add_argument("--backends", default=DEFAULT_BACKENDS, help=f"comma-separated: {','.join(BACKENDS)} "
                    f"(default {DEFAULT_BACKENDS})")
    ap.add_argument("--tmpdir", help="where the LMDB environment goes (default: the system temp dir)")
    ap.add_argument("--kv-cache-dtypes", default="bfloat16", metavar="D1,D2,..",
                    help=f"the layout's KV dtypes, measured side by side, of {KV_CACHE_DTYPES[1:]} (default bfloat16)")
    ap.add_argument("--link-mbps", type=at_least(0.0, float), default=0.0, metavar="MB/S",
                    help="each batch takes at least its bytes' time on a link this fast, as under a cost model: "
                    "every dtype at the same bytes/s, the tokens/s differ by bytes per token (default 0: none)")
    ap.add_argument("--smoke", action="store_true",
                    help="small layout, 64 blocks, 1 round (tests: numbers mean nothing)")
    args = ap.parse_args()
    if args.smoke:
        args.layout, args.blocks, args.rounds = "small", args.blocks or max(BATCHES), args.rounds or 1
    base = LAYOUTS[args.layout]
    dtypes = [d for d in args.kv_cache_dtypes.split(",") if d]
    if not dtypes or any(d not in KV_CACHE_DTYPES[1:] for d in dtypes) or len(set(dtypes)) < len(dtypes):
        raise SystemExit(f"bench_storage: --kv-cache-dtypes must name distinct dtypes of {KV_CACHE_DTYPES[1:]}, "
                         f"got {args.kv_cache_dtypes!r}")
    layouts = {d: KVLayout.of(d, num_layers=base.num_layers, kv_heads=base.kv_heads, block_size=base.block_size,
                              head_dim=base.head_dim) for d in dtypes}
    blocks = args.blocks or (64 if args.quick else 128)
    rounds = args.rounds or (3 if args.quick else 5)
    backends = [b for b in args.backends.split(",") if b]
    for b in backends:
        if b not in BACKENDS:
            raise SystemExit(f"unknown backend {b!r}")
    if blocks < max(BATCHES):
        raise SystemExit(f"--blocks must be at least {max(BATCHES)}")

    rng = np.random.default_rng(0)
    hosts = {d: rng.integers(0, 256, lay.block_bytes * blocks, np.uint8).view(lay.numpy_dtype).reshape(
        lay.host_shape(blocks)) for d, lay in layouts.items()}
    outs = {d: np.zeros_like(h) for d, h in hosts.items()}
    host_bytes = max(h.nbytes for h in hosts.values())
    try:
        workdir = tempfile.mkdtemp(prefix="fkv-bench-storage-", dir=args.tmpdir)
    except OSError as exc:
        raise SystemExit(f"bench_storage: --tmpdir: {exc}") from None
    server: LocalRedis | None = None
    pool: LocalMooncake | None = None
    results: dict[tuple[str, str, int], tuple[float, float]] = {}
    stores: dict[tuple[str, str], StorageBackend] = {}
    where: dict[str, str] = {}
    stack = contextlib.ExitStack()
    try:
        for backend, dtype in ((b, d) for b in backends for d in dtypes):
            host, out = hosts[dtype], outs[dtype]
            namespace = namespace_fingerprint("bench", layouts[dtype].describe())
            if backend == "lmdb":
                # Room for one round plus what the freed pages of earlier rounds pin.
                url = f"lmdb://{workdir}/lmdb-{dtype}?max_bytes={4 * host.nbytes}"
            elif backend.startswith("mooncake"):
                if pool is None:
                    if not MOONCAKE:
                        raise SystemExit("bench_storage: the Mooncake client is not installed "
                                         "(pip install -e '.[mooncake]')")
                    pool = LocalMooncake(segment_size=4 * host_bytes * len(dtypes) + (64 << 20), lease_ttl_ms=2000)
                    pool.start()
                url = pool.url + f"&local_buffer_size={16 << 20}"
            else:
                if args.redis_url is None and server is None:
                    try:
                        server = LocalRedis(workdir)
                    except FileNotFoundError as exc:
                        raise SystemExit(f"{exc}, or pass --redis-url") from None
                    server.start()
                    args.redis_url = server.url
                url = f"{args.redis_url}{'&' if '?' in args.redis_url else '?'}timeout=10"
            where[backend] = args.redis_url if backend.startswith("redis") else url
            try:
                stores[backend, dtype] = stack.enter_context(
                    RedisPyStore(args.redis_url, namespace, timeout=10) if backend == "redis-py"
                    else MooncakeRaw(url, host, out) if backend == "mooncake-raw" else open_store(url, namespace))
            except OSError as exc:
                raise SystemExit(f"bench_storage: backend {backend} at {where[backend]!r}: {exc}") from None
        # Rounds interleave the backends (A, B, A, B, ...), so that the machine's load at any one
        # moment falls on all of them alike.
        for batch in BATCHES:
            rates: dict[tuple[str, str], list[tuple[float, float]]] = {bd: [] for bd in stores}
            for _ in range(rounds):
                for backend, dtype in stores:
                    try:
                        rates[backend, dtype].append(
                            measure(stores[backend, dtype], hosts[dtype], outs[dtype], batch, 1, args.link_mbps * 1e6))
                    except OSError as exc:
                        raise SystemExit(f"bench_storage: backend {backend} at {where[backend]!r}: {exc}") from None
            for (backend, dtype), got in rates.items():
                results[backend, dtype, batch] = (statistics.median(p for p, _ in got),
                                                  statistics.median(g for _, g in got))
    finally:
        stack.close()
        if server is not None:
            server.kill()
        if pool is not None:
            pool.stop()
        shutil.rmtree(workdir, ignore_errors=True)

    for dtype, layout in layouts.items():
        print(f"storage tier, {layout.block_bytes / (1 << 20):g} MiB blocks ({layout.describe()}), "
              f"{blocks} blocks x {rounds} rounds, median MB/s (k tokens/s at {layout.bytes_per_token} bytes/token)"
              + (f", each batch at most {args.link_mbps:g} MB/s" if args.link_mbps else ""))
        print(f"{'backend':<13}" + "".join(f"{f'put b={b}':>18}{f'get b={b}':>18}" for b in BATCHES))
        for backend in backends:
            cells = [f"{mb:.0f} ({mb * 1e3 / layout.bytes_per_token:.0f})"
                     for b in BATCHES for mb in results[backend, dtype, b]]
            print(f"{backend:<13}" + "".join(f"{c:>18}" for c in cells))
    first = dtypes[0]
    for dtype in dtypes[1:]:  # tokens/s against the first dtype's, at batch 64
        ratio = {f"{backend} {op}": (results[backend, dtype, 64][i] / layouts[dtype].bytes_per_token)
                 / (results[backend, first, 64][i] / layouts[first].bytes_per_token)
                 for backend in backends for i, op in enumerate(("put", "get"))}
        print(f"tokens/s {dtype} / {first} at batch 64: " + ", ".join(f"{k} {v:.2f}" for k, v in ratio.items())
              + f"; at equal bytes/s: {layouts[first].bytes_per_token / layouts[dtype].bytes_per_token:.2f}")
    mbps = {}
    for backend, dtype in stores:
        put, get = results[backend, dtype, 64]
        name = backend.replace("-", "_") + ("" if dtype == first else f"_{dtype}")
        mbps[f"{name}_put"] = round(put, 1)
        mbps[f"{name}_get"] = round(get, 1)
    print(json.dumps({"bench": "storage", "mbps": mbps}))


if __name__ == "__main__":
    main()

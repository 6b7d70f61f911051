"""Builds a storage backend from a URL (the deployment's one storage setting).

    lmdb:///var/cache/fastkv/engine0?max_bytes=64G[&map_size=160G]
    redis://[:password@]host:port/db?timeout=1.0[&backoff=0.5][&max_backoff=5][&ttl=3600][&prefix=fkv]
    rediss://...   unix:///run/redis.sock?db=0&...          (same options)
    mooncake://master-host:50051?metadata_server=P2PHANDSHAKE&local_hostname=h[&protocol=tcp]
        [&rdma_devices=mlx5_0][&global_segment_size=0][&local_buffer_size=16M]   (mooncake_config.py)

Sizes take binary suffixes (K, M, G, T; "64G" = 64 GiB). Unknown options are an error, so
a typo never silently falls back to a default. LMDB's ``writemap`` is refused: with it, a
write to a full disk kills the process with SIGBUS instead of failing (without it the
store fails the write and the engine recomputes).

``probe_store(url, tp_size)`` opens a backend, makes one round trip and closes it: a
supervisor calls it before starting anything, so a tier that cannot work at all is a
configuration error rather than a run that silently recomputes everything.
"""
from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from fastkv.storage.base import StorageBackend
from fastkv.storage.sizes import parse_size


def _flag(text: str) -> bool:
    if text.lower() in ("1", "true", "yes", "on"):
        return True
    if text.lower() in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _options(query: str, kinds: dict[str, type], url: str) -> dict:
    """Parses ``query`` by ``kinds`` (option -> int/float/str/bool/"size")."""
    out = {}
    for name, raw in parse_qsl(query, keep_blank_values=True, strict_parsing=False):
        if name not in kinds:
            raise ValueError(f"unknown option {name!r} in storage URL {url!r}; known: {sorted(kinds)}")
        kind = kinds[name]
        try:
            out[name] = (parse_size(raw) if kind == "size" else _flag(raw) if kind is bool else kind(raw))
        except ValueError as e:
            raise ValueError(f"bad value for {name!r} in storage URL {url!r}: {e}") from None
    return out


_REDIS_OPTIONS = {"timeout": float, "backoff": float, "max_backoff": float, "ttl": int, "prefix": str,
                  "max_batch_bytes": "size"}
_REDIS_PASSTHROUGH = {"db"}  # left in the URL for redis-py


def open_store(url: str, namespace: bytes, rank: int = 0, tp_size: int = 1) -> StorageBackend:
    """The backend ``url`` names, serving ``rank`` of ``tp_size`` in ``namespace``."""
    if not isinstance(url, str):
        raise TypeError(f"storage URL must be a str, got {type(url).__name__}")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme == "lmdb":
        from fastkv.storage.lmdb_store import LMDBStore

        path = parts.netloc + parts.path
        if not path:
            raise ValueError(f"lmdb URL needs a directory: {url!r} (e.g. lmdb:///var/cache/fastkv)")
        if any(name == "writemap" for name, _ in parse_qsl(parts.query, keep_blank_values=True)):
            raise ValueError(f"option 'writemap' in storage URL {url!r} is not supported: with it a full disk "
                             "crashes the transfer process (SIGBUS) instead of failing the write; remove it")
        opts = _options(parts.query, {"max_bytes": "size", "map_size": "size"}, url)
        return LMDBStore(path, namespace, rank, tp_size, **opts)
    if scheme in ("redis", "rediss", "unix"):
        from fastkv.storage.redis_store import RedisStore

        ours = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in _REDIS_PASSTHROUGH]
        theirs = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k in _REDIS_PASSTHROUGH]
        opts = _options(urlencode(ours), _REDIS_OPTIONS, url)
        clean = urlunsplit((parts.scheme, parts.netloc, parts.path, urlencode(theirs), ""))
        return RedisStore(clean, namespace, rank, tp_size, **opts)
    if scheme == "mooncake":
        from fastkv.storage.mooncake_config import from_url
        from fastkv.storage.mooncake_store import MooncakeStore

        return MooncakeStore(namespace, rank, tp_size, **from_url(url))
    raise ValueError(f"unknown storage URL scheme {parts.scheme!r} in {url!r}; use lmdb://, redis:// or mooncake://")


@contextmanager
def _quiet_stderr() -> Iterator[None]:
    """A C client's own log lines (Mooncake's glog) go nowhere while it is probed: the probe's
    outcome is the one line the caller prints."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null:
            os.dup2(null.fileno(), 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)


def probe_store(url: str, tp_size: int = 1, timeout: float = 1.0) -> None:
    """Opens the backend ``url`` names, makes one round trip (``check``) and closes it;
    ValueError in one line naming the URL if it cannot serve. A network backend waits at
    most ``timeout`` seconds (its own timeout option is for the run, not for this probe)."""
    from fastkv.storage.base import namespace_fingerprint

    parts = urlsplit(url)
    probe_url = url
    if parts.scheme.lower() == "mooncake":
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "connect_timeout"]
        probe_url = urlunsplit(parts._replace(query=urlencode([*query, ("connect_timeout", str(timeout))])))
    if parts.scheme.lower() in ("redis", "rediss", "unix"):
        query = [(k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k != "timeout"]
        probe_url = urlunsplit(parts._replace(query=urlencode([*query, ("timeout", str(timeout))])))
    try:
        with _quiet_stderr(), open_store(probe_url, namespace_fingerprint("fastkv probe"), 0, tp_size) as store:
            store.check()
    except Exception as exc:  # whatever the backend raises: one line with the URL and the cause
        why = " ".join(str(exc).replace(probe_url, url).split())
        if not isinstance(exc, ValueError):
            why = f"{type(exc).__name__}: {why}"
        raise ValueError(why if url in why else f"storage tier {url!r} cannot be used: {why}") from None

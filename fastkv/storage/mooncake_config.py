"""Mooncake store settings as FastDeploy users write them, and the ``mooncake://`` URL.

FastDeploy (``kvcache_storage_backend = "mooncake"``) takes seven keys, each from the first
of these that has it: the job's ``kvcache_storage_config`` table, the JSON file named by
``MOONCAKE_CONFIG_PATH``, then one ``MOONCAKE_*`` environment variable per key::

    local_hostname       MOONCAKE_LOCAL_HOSTNAME       this host's address as peers reach it
    metadata_server      MOONCAKE_METADATA_SERVER      P2PHANDSHAKE, or http://host:port/metadata
    master_server_addr   MOONCAKE_MASTER_SERVER_ADDR   host:port of mooncake_master (required)
    global_segment_size  MOONCAKE_GLOBAL_SEGMENT_SIZE  memory this process lends the pool
    local_buffer_size    MOONCAKE_LOCAL_BUFFER_SIZE    the client's own transfer buffer
    protocol             MOONCAKE_PROTOCOL             tcp | rdma
    rdma_devices         MOONCAKE_RDMA_DEVICES         e.g. mlx5_0,mlx5_1 (one per rank, by rank)

fastkv resolves them once, in the supervisor, into one URL that every transfer process
opens (``--storage`` takes the same URL)::

    mooncake://MASTER_HOST:PORT?metadata_server=P2PHANDSHAKE&local_hostname=10.0.0.5
        [&protocol=tcp][&rdma_devices=mlx5_0][&global_segment_size=0][&local_buffer_size=16M]
        [&prefix=fkv][&backoff=0.5][&max_backoff=5][&connect_timeout=1]

A URL key it does not give comes from the file, then the environment, then the default.
Engines lend no memory by default (``global_segment_size=0``): a pool that outlives an
engine lives in a long-lived holder (``mooncake://local`` starts one, see local_mooncake.py).
Unknown keys are an error, never a silently ignored typo.
"""
from __future__ import annotations

import json
import os
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit

KEYS = ("local_hostname", "metadata_server", "master_server_addr", "global_segment_size", "local_buffer_size",
        "protocol", "rdma_devices")
ENV = {key: f"MOONCAKE_{key.upper()}" for key in KEYS}
SIZES = ("global_segment_size", "local_buffer_size")
DEFAULTS = {"local_hostname": "127.0.0.1", "metadata_server": "P2PHANDSHAKE", "global_segment_size": "0",
            "local_buffer_size": "16M", "protocol": "tcp", "rdma_devices": ""}
# fastkv's own options, URL only
OPTIONS = {"prefix": str, "backoff": float, "max_backoff": float, "connect_timeout": float}
PROTOCOLS = ("tcp", "rdma")


def _file_config() -> tuple[dict, str]:
    path = os.environ.get("MOONCAKE_CONFIG_PATH")
    if not path:
        return {}, ""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path}: cannot read it as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise ValueError(f"MOONCAKE_CONFIG_PATH={path}: must hold a JSON object of Mooncake settings")
    return doc, f"MOONCAKE_CONFIG_PATH={path}"


def resolve(table: dict | None = None) -> dict[str, str]:
    """The seven keys, each from ``table`` > the JSON file > the environment > the default.
    FastDeploy-only keys in the file (e.g. its older ``master_server_address``) are named
    in the error rather than ignored."""
    table = dict(table or {})
    unknown = set(table) - set(KEYS)
    if unknown:
        raise ValueError(f"kvcache_storage_config: unknown Mooncake keys {sorted(unknown)}; known: {list(KEYS)}")
    file_cfg, where = _file_config()
    unknown = set(file_cfg) - set(KEYS)
    if unknown:
        raise ValueError(f"{where}: unknown Mooncake keys {sorted(unknown)}; known: {list(KEYS)}")
    out = {}
    for key in KEYS:
        for source in (table, file_cfg):
            if key in source and source[key] is not None:
                out[key] = str(source[key])
                break
        else:
            if os.environ.get(ENV[key]):
                out[key] = os.environ[ENV[key]]
            elif key in DEFAULTS:
                out[key] = DEFAULTS[key]
    if not out.get("master_server_addr"):
        raise ValueError("Mooncake needs master_server_addr (host:port of mooncake_master): set it in "
                         "kvcache_storage_config, in the JSON file at MOONCAKE_CONFIG_PATH, or as "
                         "MOONCAKE_MASTER_SERVER_ADDR")
    return out


def to_url(settings: dict[str, str]) -> str:
    """The ``mooncake://`` URL of resolved settings."""
    query = {k: v for k, v in settings.items() if k != "master_server_addr"}
    return f"mooncake://{settings['master_server_addr']}?{urlencode(query)}"


def from_url(url: str) -> dict:
    """The backend's keyword arguments for ``url``: the URL's keys over resolve()'s."""
    from fastkv.storage.sizes import parse_size

    parts = urlsplit(url)
    if not parts.netloc or parts.netloc == "local":
        raise ValueError(f"mooncake URL needs the master's host:port: {url!r} (mooncake://local is for "
                         "--storage, where the supervisor starts a local pool)")
    given: dict[str, str] = {}
    opts: dict = {}
    for name, raw in parse_qsl(parts.query, keep_blank_values=True):
        if name in OPTIONS:
            try:
                opts[name] = OPTIONS[name](raw)
            except ValueError:
                raise ValueError(f"bad value for {name!r} in storage URL {url!r}: {raw!r}") from None
        elif name in KEYS and name != "master_server_addr":
            given[name] = raw
        else:
            known = sorted(set(KEYS) - {"master_server_addr"} | set(OPTIONS))
            raise ValueError(f"unknown option {name!r} in storage URL {url!r}; known: {known}")
    settings = resolve({**given, "master_server_addr": parts.netloc})
    for key in SIZES:
        try:
            settings[key] = parse_size(settings[key])
        except ValueError as exc:
            raise ValueError(f"bad value for {key!r} of storage URL {url!r}: {exc}") from None
    if settings["protocol"] not in PROTOCOLS:
        raise ValueError(f"bad value for 'protocol' of storage URL {url!r}: {settings['protocol']!r} "
                         f"(one of {PROTOCOLS})")
    host, _, port = parts.netloc.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"mooncake URL needs the master address as host:port, got {parts.netloc!r} in {url!r}")
    return {**settings, **opts}

"""A Mooncake client that only lends memory to the pool: objects live in the segment of the
process that holds them, so a pool that outlives engines needs a process like this one.

    python -m fastkv.storage.mooncake_holder MASTER_HOST:PORT SEGMENT_SIZE
        [--metadata-server P2PHANDSHAKE|http://host:port/metadata] [--local-hostname HOST]
        [--protocol tcp|rdma] [--rdma-devices mlx5_0]

It takes the same settings as the engines, from the same places (mooncake_config.py: a flag, then
the JSON file at ``MOONCAKE_CONFIG_PATH``, then ``MOONCAKE_*`` variables, then the default), so its
segment is reachable the way the engines look for it: with a master that serves HTTP metadata,
give both ``--metadata-server http://MASTER_HOST:8080/metadata``. ``SEGMENT_SIZE`` is bytes or a
size (``4G``). Prints ``ready`` once its segment is mounted, then holds it until its standard
input closes (its parent exited, however it exited) or it gets SIGTERM. A setting it cannot
serve ends it at once, rc 2, in one line.
"""
from __future__ import annotations

import argparse
import signal
import sys


def settings(argv: list[str]) -> tuple[str, int, dict[str, str]]:
    """(master, segment bytes, the client's setup settings); ValueError in the user's terms."""
    from fastkv.storage.mooncake_config import PROTOCOLS, resolve
    from fastkv.storage.sizes import parse_size

    p = argparse.ArgumentParser(prog="python -m fastkv.storage.mooncake_holder",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("master", help="host:port of mooncake_master")
    p.add_argument("segment_size", help="memory lent to the pool: bytes, or a size such as 4G")
    for flag in ("metadata-server", "local-hostname", "protocol", "rdma-devices"):
        p.add_argument(f"--{flag}", help="as the engines' key of the same name (default: theirs)")
    args = p.parse_args(argv)
    try:
        size = parse_size(args.segment_size)
    except ValueError as exc:
        raise ValueError(f"SEGMENT_SIZE {args.segment_size!r}: {exc}") from None
    host, _, port = args.master.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"MASTER must be host:port, got {args.master!r}")
    given = {k: v for k, v in (("metadata_server", args.metadata_server), ("local_hostname", args.local_hostname),
                               ("protocol", args.protocol), ("rdma_devices", args.rdma_devices)) if v is not None}
    cfg = resolve({**given, "master_server_addr": args.master})
    if cfg["protocol"] not in PROTOCOLS:
        raise ValueError(f"--protocol must be one of {PROTOCOLS}, got {cfg['protocol']!r}")
    meta = cfg["metadata_server"]
    if meta != "P2PHANDSHAKE" and not meta.startswith(("http://", "https://", "etcd://")):
        raise ValueError(f"--metadata-server must be P2PHANDSHAKE or a metadata server's URL, got {meta!r}")
    return args.master, size, cfg


def main(argv: list[str]) -> int:
    try:
        master, size, cfg = settings(argv)
    except ValueError as exc:
        print(f"mooncake holder: {exc}", file=sys.stderr)
        return 2
    from fastkv.storage.mooncake_store import MooncakeDistributedStore, _require, check_reachable

    _require()
    try:
        check_reachable(master, 2.0)
    except ConnectionError as exc:
        print(f"mooncake holder: {exc}", file=sys.stderr)
        return 2
    store = MooncakeDistributedStore()
    device = cfg["rdma_devices"].split(",")[0].strip()
    ret = store.setup(cfg["local_hostname"], cfg["metadata_server"], size, 1 << 20, cfg["protocol"], device, master)
    if ret != 0:
        print(f"mooncake holder: setup against master {master} failed with code {ret} (metadata "
              f"{cfg['metadata_server']}, protocol {cfg['protocol']}, local_hostname {cfg['local_hostname']})",
              file=sys.stderr)
        return 1
    signal.signal(signal.SIGTERM, lambda *_: sys.stdin.close())
    print("ready", flush=True)
    try:
        sys.stdin.buffer.read()  # blocks until the parent closes the pipe or exits
    except (ValueError, OSError):  # closed by the SIGTERM handler
        pass
    store.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

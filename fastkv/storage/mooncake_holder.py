"""A Mooncake client that only lends memory to the pool: objects live in the segment of the
process that holds them, so a pool that outlives engines needs a process like this one.

    python -m fastkv.storage.mooncake_holder MASTER_HOST:PORT SEGMENT_BYTES

Prints ``ready`` once its segment is mounted, then holds it until its standard input
closes (its parent exited, however it exited) or it gets SIGTERM.
"""
from __future__ import annotations

import signal
import sys


def main(argv: list[str]) -> int:
    if len(argv) != 2 or not argv[1].isdigit():
        print("usage: python -m fastkv.storage.mooncake_holder MASTER_HOST:PORT SEGMENT_BYTES", file=sys.stderr)
        return 2
    from fastkv.storage.mooncake_store import MooncakeDistributedStore, _require, check_reachable

    _require()

    check_reachable(argv[0], 2.0)
    store = MooncakeDistributedStore()
    ret = store.setup("127.0.0.1", "P2PHANDSHAKE", int(argv[1]), 1 << 20, "tcp", "", argv[0])
    if ret != 0:
        print(f"mooncake holder: setup against master {argv[0]} failed with code {ret}", file=sys.stderr)
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

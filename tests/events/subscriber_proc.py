"""A subscriber in a process of its own, for tests that kill one: it applies every batch from
ENDPOINT (a hole: replay from REPLAY) until SIGTERM, then takes the tail by replay and writes
what it holds to OUT as JSON (keys hex per medium). ``OUT.ready`` appears once it subscribed.

    python -m tests.events.subscriber_proc ENDPOINT REPLAY OUT
"""
from __future__ import annotations

import json
import signal
import sys
from pathlib import Path

from fastkv.routing.indexer import Indexer


def main(endpoint: str, replay: str, out: str) -> int:
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    idx = Indexer()
    view = idx.add("e0", endpoint, replay)
    Path(out + ".ready").touch()
    while not stop:
        idx.poll(0.05)
    idx.sync()
    Path(out).write_text(json.dumps({"next_seq": view.next_seq, "batches": view.batches, "gaps": view.gaps,
                                     "lost": view.lost, "held": {m: sorted(k.hex() for k in keys)
                                                                 for m, keys in view.held.items()}}))
    idx.close()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))

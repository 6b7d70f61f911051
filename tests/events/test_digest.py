# ruff: noqa: E402  (the imports below need the extra checked first)
"""The summary's ``kv_events`` figures a subscriber can check (``batches``, ``events``,
``resident.<medium>.keys`` / ``.digest``), recomputed from a subscriber's own key sets by the
definition in docs/FORMATS.md, not by fastkv's digest function. The summary takes them from
``KVEvents.stats()`` and ``KVEvents.resident()`` (fastkv.engine.health)."""

from tests.optional import require_events

require_events()  # the events extra: a skip without it (a failure under CI), not a collection error

import re
from pathlib import Path

import blake3
import pytest

from fastkv.events import EventsConfig
from fastkv.events.config import SCHEMAS
from tests.events.consumers import CONSUMERS, READS, apply_batch
from tests.events.demo_rig import make_rig, run_demo

DOC = Path(__file__).resolve().parents[2] / "docs" / "FORMATS.md"
MEDIA = ("GPU", "CPU", "DISK")


def documented_digest(keys: set[bytes]) -> str:
    """docs/FORMATS.md: BLAKE3 (unkeyed, 32 bytes, hex) of the 32-byte keys sorted ascending, concatenated."""
    assert all(isinstance(k, bytes) and len(k) == 32 for k in keys)
    h = blake3.blake3()
    for k in sorted(keys):
        h.update(k)
    return h.hexdigest()


def test_an_empty_medium_has_the_documented_digest():
    row = re.search(r"^\| `kv_events\.resident\.<medium>\.digest` \|(.*)$", DOC.read_text(), re.M)
    assert row, "docs/FORMATS.md does not define kv_events.resident.<medium>.digest"
    empty = re.search(r"`([0-9a-f]{64})`", row.group(1)).group(1)
    assert documented_digest(set()) == empty
    _, ev = make_rig(EventsConfig(endpoint="inproc://digest-empty"))
    try:
        assert ev.resident() == {m: {"keys": 0, "digest": empty} for m in MEDIA}
    finally:
        ev.close()


@pytest.mark.parametrize("name", SCHEMAS)
def test_the_summary_figures_are_a_subscribers_own(tmp_path, name):
    rig, ev = run_demo(EventsConfig(endpoint=f"inproc://digest-{name}", schema=name, buffer_steps=100_000))
    try:
        assert ev.sync(10.0)
        consumer = sorted(c for c in READS[name] if c != "llm-d")[0]  # keeps the 32-byte keys unfolded
        held: dict[str, set] = {m: set() for m in MEDIA}
        seqs, events = [], 0
        for seq, payload in ev.publisher.buffer:
            seqs.append(seq)
            _, batch = CONSUMERS[consumer](payload)
            events += len(batch)
            apply_batch(held, batch)
        stats, resident = ev.stats(), ev.resident()
        assert seqs == list(range(stats["batches"]))
        assert events == stats["events"]
        assert resident == {m: {"keys": len(held[m]), "digest": documented_digest(held[m])} for m in MEDIA}
        assert held["GPU"] and held["CPU"]  # something to compare
    finally:
        ev.close()

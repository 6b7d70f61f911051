from __future__ import annotations

import os
import time

import pytest

from fastkv.ipc import BadMessage, ChannelClosed, MessageTooLarge, PeerTimeout, Ring, Side
from fastkv.ipc.ring import HEADER


def test_messages_span_slots_and_wrap(ns):
    ring = Ring.create(ns, "r", slot_size=32, nslots=6)  # 24 payload bytes per slot
    assert ring.capacity_bytes == 144
    for rnd in range(20):  # moves head/tail around the ring many times
        msgs = [bytes([rnd]) * n for n in (0, 1, 24, 25, 49)]  # 1+1+1+2+3 = 8 slots: not all at once
        ring.push_many(msgs[:3], timeout=0)
        ring.check_integrity()
        assert ring.pop_many(2, timeout=0) == msgs[:2]
        ring.push_many(msgs[3:], timeout=0)
        ring.check_integrity()
        assert ring.used() == 1 + 2 + 3
        assert ring.pop_many(10, timeout=0) == msgs[2:]
    ring.close()


def test_too_large_is_refused_and_ring_untouched(ns):
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    ring.push(b"a")
    with pytest.raises(MessageTooLarge, match="exceeds the ring capacity of 96 bytes"):
        ring.push(b"x" * 97)
    ring.push(b"y" * 72)  # three slots: exactly fills the rest
    with pytest.raises(PeerTimeout, match="full"):
        ring.push(b"z", timeout=0.05)
    assert ring.pop_many(10, timeout=0) == [b"a", b"y" * 72]
    ring.check_integrity()
    ring.close()


def test_bad_message_in_a_batch_keeps_the_good_ones(ns):
    ring = Ring.create(ns, "r", slot_size=32, nslots=8)
    with pytest.raises(MessageTooLarge):
        ring.push_many([b"ok", b"x" * 1000, b"after"])
    # the first buffer went in, the oversized one stopped the batch
    assert ring.pop_many(8, timeout=0) == [b"ok"]
    ring.close()


def test_empty_pop_times_out_without_error(ns):
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    t0 = time.monotonic()
    assert ring.pop_many(4, timeout=0.12) == []
    # it waited its timeout; the upper bound only catches a wait that ignores it (a loaded
    # 2-core machine can keep the woken thread off a core for a second or more)
    assert 0.1 <= time.monotonic() - t0 < 10.0
    assert ring.pop_many(4, timeout=0) == []
    ring.close()


def test_corrupt_frame_raises_and_ring_recovers(ns):
    ring = Ring.create(ns, "r", slot_size=32, nslots=4)
    ring.push_many([b"first", b"second"])
    ring._mm[HEADER + 32 + 4] ^= 0xFF  # the second frame's sequence number
    assert ring.pop_many(1, timeout=0) == [b"first"]
    with pytest.raises(BadMessage, match="sequence number"):
        ring.pop_many(4, timeout=0)
    assert ring.used() == 0
    ring.push(b"third")
    assert ring.pop_many(4, timeout=0) == [b"third"]
    ring.check_integrity()
    ring.close()


def test_closed_rings(ns):
    prod = Ring.create(ns, "r", slot_size=32, nslots=4)
    cons = Ring.attach(ns, "r").bind(Side.CONSUMER, "engine")
    prod.bind(Side.PRODUCER, "transfer", 3)
    prod.push(b"last words")
    prod.close()
    with pytest.raises(ChannelClosed, match="closed in this process"):
        prod.push(b"x")
    assert cons.pop_many(4, timeout=1) == [b"last words"]  # drained before the close is reported
    with pytest.raises(ChannelClosed, match="producer closed"):
        cons.pop_many(4, timeout=1)
    cons.close()
    again = Ring.attach(ns, "r")
    with pytest.raises(ChannelClosed, match="consumer closed"):
        again.push(b"x")
    again.close()


def test_bind_records_peer(ns):
    ring = Ring.create(ns, "r").bind(Side.PRODUCER, "engine", 0)
    peer = ring.peer(Side.PRODUCER)
    assert peer.role == "engine" and peer.rank == 0 and peer.alive()
    assert ring.peer(Side.CONSUMER).pid == 0
    assert ring.peer_id(Side.PRODUCER) == (os.getpid(), peer.started) and ring.peer_id(Side.CONSUMER) == (0, 0)
    with pytest.raises(ValueError, match="16 bytes"):
        ring.bind(Side.CONSUMER, "x" * 17)
    ring.close()


def test_bad_geometry(ns):
    with pytest.raises(ValueError, match="slot_size"):
        Ring.create(ns, "a", slot_size=20)
    with pytest.raises(ValueError, match="nslots"):
        Ring.create(ns, "b", nslots=0)


@pytest.mark.parametrize("corrupt", ["seq", "length", "continuation"])
def test_a_corrupt_frame_drops_only_itself_and_is_counted(ns, corrupt):
    ring = Ring.create(ns, "r", slot_size=32, nslots=8)  # 24 payload bytes per slot
    big = bytes(range(60))  # three slots: 1..3
    ring.push_many([b"first", big, b"third", b"fourth"])
    off = {"seq": HEADER + 32 + 4, "length": HEADER + 32 + 1, "continuation": HEADER + 2 * 32 + 4}[corrupt]
    ring._mm[off] ^= 0xFF
    assert ring.pop_many(8, timeout=0) == [b"first"]
    with pytest.raises(BadMessage, match="corrupt frame at index 1 .*dropped 3 slots"):
        ring.pop_many(8, timeout=0)
    assert ring.pop_many(8, timeout=0) == [b"third", b"fourth"]
    assert ring.dropped == 1
    ring.check_integrity()
    ring.close()

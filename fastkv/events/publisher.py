"""The ZMQ publisher of KV event batches, off the engine step's critical path.

Wire protocol, as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) and llm-d's
subscriber (``pkg/kvcache/kvevents/zmq_subscriber.go``) speak it:

* a PUB socket sends each batch as the multipart message
  ``[topic, 8-byte big-endian sequence number, msgpack(EventBatch)]``; sequence numbers count
  from 0 with no holes on the engine's side, so a subscriber that sees one skipped lost a batch.
* an optional ROUTER socket replays: a client (DEALER or REQ) sends ``[b"", start]`` with
  ``start`` 8 bytes big-endian; the publisher answers ``[b"", seq, payload]`` for every batch
  it still buffers from ``start`` on, then ``[b"", -1 as 8 signed bytes, b""]``.

The engine thread encodes a batch (msgspec, microseconds), appends it to the replay buffer (a
bounded deque) and hands it to the PUB socket with a non-blocking send: ZMQ's own I/O thread
(C++, no GIL) does the network work, so no Python thread is woken per batch. (vLLM relays
through a Python thread and a queue; such a relay costs the engine thread GIL hand-offs on
every batch, a sizeable share of a small step.) A subscriber ``hwm`` batches behind loses the newer
ones at its ZMQ queue, as ZMQ PUB does, silently to the publisher: the subscriber sees the hole
in the sequence numbers and replays it (fastkv.routing.indexer counts ``gaps`` and ``lost``).
A send ZMQ refuses (a connecting PUB before its peer is up) is counted in ``dropped``, and that
batch too stays in the replay buffer. Memory: ``buffer_steps`` batches, plus ``hwm`` per
subscriber inside ZMQ. Replay requests are served by a thread that blocks in
``zmq.Poller.poll`` on the ROUTER socket (no sleep-polling); it wakes only for them.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

import msgspec
import zmq

from fastkv.events.config import EventsConfig, binds

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b""
_ids = itertools.count()


class ZmqPublisher:
    def __init__(self, config: EventsConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0  # the next batch's sequence number
        self.dropped = 0  # batches ZMQ refused to take (they stay in the replay buffer)
        self.replays = 0
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        pipe = f"inproc://fastkv-events-{next(_ids)}"
        try:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.sndhwm = config.hwm
            (self.pub.bind if binds(config.endpoint) else self.pub.connect)(config.endpoint)
            self.router = self._stop = self._thread = None
            if config.replay_endpoint:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.sndhwm = config.buffer_steps + 2  # one whole replay fits
                self.router.bind(config.replay_endpoint)
                self._stop = self.ctx.socket(zmq.PAIR)
                self._stop.bind(pipe)
                wake = self.ctx.socket(zmq.PAIR)
                wake.connect(pipe)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise ValueError(f"kv events: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc}") \
                from None
        if self.router is not None:
            self._thread = threading.Thread(target=self._serve_replays, args=(wake,), name="fastkv-kv-replay",
                                            daemon=True)
            self._thread.start()

    def publish(self, batch: object) -> int:
        """Encode ``batch``, keep it for replay and send it; never waits. Returns its seq."""
        payload = self._encode(batch)
        seq = self.seq
        self.seq += 1
        self.buffer.append((seq, payload))
        try:
            self.pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), flags=zmq.NOBLOCK)
        except zmq.Again:
            self.dropped += 1
        return seq

    def _serve_replays(self, wake: zmq.Socket) -> None:
        router = self.router
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        while True:
            try:
                ready = dict(poller.poll())
            except zmq.ContextTerminated:  # close() gave up waiting for the thread
                return
            if wake in ready:
                wake.close(linger=0)
                return
            if router in ready:
                self._replay(router)

    def _replay(self, router: zmq.Socket) -> None:
        while True:
            try:
                frames = router.recv_multipart(flags=zmq.NOBLOCK)
            except zmq.Again:
                return
            if len(frames) != 3:
                continue  # not a replay request
            client, _, start = frames
            first = int.from_bytes(start, "big")
            self.replays += 1
            for seq, payload in tuple(self.buffer):  # one C call: no engine append interleaves it
                if seq >= first:
                    router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", END_SEQ, b""))

    def stats(self) -> dict[str, int]:
        return {"batches": self.seq, "dropped": self.dropped, "replays": self.replays,
                "buffered": len(self.buffer), "buffered_bytes": sum(len(p) for _, p in tuple(self.buffer))}

    def close(self) -> None:
        """Stop the replay thread and close every socket."""
        if self._thread is not None and self._thread.is_alive():
            self._stop.send(_STOP)
            self._thread.join(timeout=5.0)
        self.pub.close(linger=1000)  # up to 1 s to hand connected subscribers the last batches
        self.ctx.destroy(linger=0)

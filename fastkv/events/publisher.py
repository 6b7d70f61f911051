"""The ZMQ publisher of KV event batches, off the engine step's critical path.

Wire protocol, as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) and llm-d's
subscriber (``pkg/kvcache/kvevents/zmq_subscriber.go``) speak it:

* a PUB socket sends each batch as the multipart message
  ``[topic, 8-byte big-endian sequence number, msgpack(EventBatch)]``; sequence numbers count
  from 0 with no holes on the engine's side, so a subscriber that sees one skipped lost a batch.
* an optional ROUTER socket replays: a client (DEALER or REQ) sends ``[b"", start]`` with
  ``start`` 8 bytes big-endian; the publisher answers ``[b"", seq, payload]`` for every batch
  it still buffers from ``start`` on, then ``[b"", -1 as 8 signed bytes, b""]``.

The engine thread encodes a batch (msgspec, microseconds), appends it to the replay buffer
(a bounded deque) and hands it to the publisher thread over an inproc PAIR socket with a
non-blocking send: when the thread is ``hwm`` batches behind, the batch is dropped from the live
stream and counted (``dropped``); it stays in the replay buffer, so a subscriber sees the hole
and replays it. The thread blocks in ``zmq.Poller.poll`` on the PAIR and the ROUTER sockets
(no sleep-polling); the PUB socket itself drops messages for a subscriber ``hwm`` behind, as
ZMQ does, which the subscriber again sees as a hole. Memory is bounded by ``buffer_steps``
batches plus twice ``hwm`` in flight.
"""
from __future__ import annotations

import itertools
import threading
from collections import deque

import msgspec
import zmq

from fastkv.events.config import EventsConfig

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_STOP = b""
_ids = itertools.count()


def _binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard address, ipc:// or inproc:// binds; a host address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqPublisher:
    """``start=False`` leaves the publisher thread unstarted until ``start()``: batches queue
    up to ``hwm`` and the rest are dropped (what a stalled thread looks like to the engine)."""

    def __init__(self, config: EventsConfig, start: bool = True) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0  # the next batch's sequence number
        self.dropped = 0  # batches the publisher thread was too far behind to take
        self.replays = 0
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        pipe = f"inproc://fastkv-events-{next(_ids)}"
        try:
            self.pub = self.ctx.socket(zmq.PUB)
            self.pub.sndhwm = config.hwm
            (self.pub.bind if _binds(config.endpoint) else self.pub.connect)(config.endpoint)
            self.router = None
            if config.replay_endpoint:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.sndhwm = config.buffer_steps + 2  # one whole replay fits
                self.router.bind(config.replay_endpoint)
            self._tx = self.ctx.socket(zmq.PAIR)
            self._tx.sndhwm = config.hwm
            self._tx.bind(pipe)
            self._rx = self.ctx.socket(zmq.PAIR)
            self._rx.rcvhwm = 1
            self._rx.connect(pipe)
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise ValueError(f"kv events: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc}") \
                from None
        self._thread = threading.Thread(target=self._loop, name="fastkv-kv-events", daemon=True)
        if start:
            self._thread.start()

    def start(self) -> None:
        self._thread.start()

    def publish(self, batch: object) -> int:
        """Encode ``batch`` and hand it to the publisher thread; never waits. Returns its seq."""
        payload = self._encode(batch)
        seq = self.seq
        self.seq += 1
        seq8 = seq.to_bytes(8, "big")
        self.buffer.append((seq, payload))
        try:
            self._tx.send_multipart((seq8, payload), flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            self.dropped += 1
        return seq

    def _loop(self) -> None:
        rx, pub, router = self._rx, self.pub, self.router
        poller = zmq.Poller()
        poller.register(rx, zmq.POLLIN)
        if router is not None:
            poller.register(router, zmq.POLLIN)
        topic = self._topic
        while True:
            try:
                ready = dict(poller.poll())
            except zmq.ContextTerminated:  # close() gave up waiting for the thread
                return
            if router is not None and router in ready:
                self._replay(router)
            if rx in ready:
                while True:
                    try:
                        frames = rx.recv_multipart(flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:
                        break
                    if len(frames) == 1:
                        return  # close()
                    try:
                        pub.send_multipart((topic, frames[0], frames[1]), flags=zmq.NOBLOCK, copy=False)
                    except zmq.Again:  # a connecting PUB with no peer yet: the batch waits in replay
                        pass

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
                "buffered": len(self.buffer)}

    def close(self) -> None:
        """Stop the thread (it sends what it has been handed first) and close every socket."""
        if self._thread.is_alive():
            self._tx.sndtimeo = 2000
            try:
                self._tx.send(_STOP)
            except zmq.Again:
                pass
            self._thread.join(timeout=5.0)
        self.ctx.destroy(linger=0)

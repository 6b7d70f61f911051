"""The ZMQ publisher of KV event batches, off the engine step's critical path.

Wire protocol, as vLLM's ``ZmqEventPublisher`` (``vllm/distributed/kv_events.py``) and llm-d's
subscriber (``pkg/kvcache/kvevents/zmq_subscriber.go``) speak it:

* each batch goes out as the multipart message
  ``[topic, 8-byte big-endian sequence number, msgpack(EventBatch)]``; sequence numbers count
  from 0 with no holes on the engine's side, so a subscriber that sees one skipped lost a batch.
* an optional ROUTER socket replays: a client (DEALER or REQ) sends ``[b"", start]`` with
  ``start`` 8 bytes big-endian; the publisher answers ``[b"", seq, payload]`` for every batch
  it still buffers from ``start`` on, then ``[b"", -1 as 8 signed bytes, b""]``.

Threads. The engine thread only hands the step's changes over (``publish``: a sequence number
and a bounded queue put). The publisher thread builds and encodes the batch, appends it to the
replay buffer (a bounded deque) and sends it; ZMQ's own I/O thread (C++, no GIL) does the
network work. The publisher thread's Python runs mostly while the engine thread waits for its
workers, GIL released. A replay thread blocks in ``zmq.Poller.poll`` on the ROUTER socket and
wakes only for replay requests.

Drops are counted here, at the publisher. The socket is an XPUB (wire-compatible with PUB: SUB
sockets subscribe to it unchanged) with ``ZMQ_XPUB_NODROP``: a send fails with EAGAIN instead
of silently skipping a subscriber whose queue holds ``hwm`` batches. Such a batch is counted in
``dropped`` and kept in the replay buffer; no subscriber gets it live (ZMQ sends to all or, under
NODROP, to none), so each sees the hole and can replay it. So that one stalled subscriber does
not cost the healthy ones more than a moment, once sends have failed for ``stall_timeout_ms``
the next batch goes out once without NODROP: it reaches every subscriber with room, and ZMQ
sets the full queues aside (``set_aside``) until their subscribers read again, as a PUB socket
would. A subscriber set aside loses the batches meanwhile, and sees the hole when it resumes.
Memory: ``buffer_steps`` batches, up to ``hwm`` per subscriber inside ZMQ, and at most
``QUEUE_BATCHES`` handed over and not yet encoded.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from fastkv.events.config import EventsConfig, binds

END_SEQ = (-1).to_bytes(8, "big", signed=True)
QUEUE_BATCHES = 1024  # handed over, not yet encoded: past this the engine thread waits for the encoder
_STOP = None
log = logging.getLogger(__name__)


class ZmqPublisher:
    def __init__(self, config: EventsConfig) -> None:
        self.config = config
        self.ctx = zmq.Context()
        self.buffer: deque[tuple[int, bytes]] = deque(maxlen=config.buffer_steps)
        self.seq = 0  # the next batch's sequence number (engine thread)
        self.done = 0  # batches encoded, buffered and sent or dropped (publisher thread)
        self.dropped = 0  # batches a subscriber's full queue refused (they stay in the replay buffer)
        self.set_aside = 0  # times stalled subscribers' queues were set aside so the others get batches
        self._refused_since: float | None = None  # when the current run of refused sends began
        self.replays = 0
        self.errors = 0  # batches that failed to build or send (a bug: logged once)
        self.encode_cpu_s = 0.0  # publisher-thread CPU time building, encoding and sending
        self._topic = config.topic.encode()
        self._encode = msgspec.msgpack.Encoder().encode
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # C: the engine thread's put is the cheapest handoff
        self._done = threading.Condition()
        self.router = self._thread = self._replayer = self._wake = None
        try:
            self.pub = self.ctx.socket(zmq.XPUB)
            self.pub.sndhwm = config.hwm
            self.pub.setsockopt(zmq.XPUB_NODROP, 1)
            (self.pub.bind if binds(config.endpoint) else self.pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self.router = self.ctx.socket(zmq.ROUTER)
                self.router.sndhwm = config.buffer_steps + 2  # one whole replay fits
                self.router.bind(config.replay_endpoint)
                self._wake = self.ctx.socket(zmq.PAIR)
                self._wake.bind(f"inproc://fastkv-events-{id(self)}")
                wake = self.ctx.socket(zmq.PAIR)
                wake.connect(f"inproc://fastkv-events-{id(self)}")
        except zmq.ZMQError as exc:
            self.ctx.destroy(linger=0)
            raise ValueError(f"kv events: cannot open {config.endpoint!r} / {config.replay_endpoint!r}: {exc}") \
                from None
        self._thread = threading.Thread(target=self._publish_loop, name="fastkv-kv-events", daemon=True)
        self._thread.start()
        if self.router is not None:
            self._replayer = threading.Thread(target=self._serve_replays, args=(wake,), name="fastkv-kv-replay",
                                              daemon=True)
            self._replayer.start()

    # ---------------------------------------------------------------- engine thread
    def publish(self, batch: Any | Callable[[], Any]) -> int:
        """Hand ``batch`` (or a function that builds it, called on the publisher thread) over
        to be encoded, kept for replay and sent; returns its sequence number. Waits only while
        ``QUEUE_BATCHES`` batches are still unencoded."""
        seq = self.seq
        if seq - self.done >= QUEUE_BATCHES:  # the encoder fell behind: wait for its CPU, never a subscriber
            with self._done:
                self._done.wait_for(lambda: seq - self.done < QUEUE_BATCHES)
        self.seq += 1
        self._queue.put((seq, batch))
        return seq

    def sync(self, timeout: float | None = None) -> bool:
        """Wait until every batch handed over so far is buffered and sent (or dropped)."""
        target = self.seq
        with self._done:
            return self._done.wait_for(lambda: self.done >= target, timeout)

    # ---------------------------------------------------------------- publisher thread
    def _publish_loop(self) -> None:
        pub, send = self.pub, self.pub.send_multipart
        while True:
            item = self._queue.get()
            if item is _STOP:
                return
            c0 = time.thread_time()
            seq, batch = item
            try:
                payload = self._encode(batch() if callable(batch) else batch)
                self.buffer.append((seq, payload))
                frames = (self._topic, seq.to_bytes(8, "big"), payload)
                try:
                    send(frames, flags=zmq.NOBLOCK)
                    self._refused_since = None
                except zmq.Again:  # a subscriber's queue is full: nobody gets it live
                    self.dropped += 1
                    self._stalled(frames)
                while pub.poll(0):  # (un)subscriptions: read so that they do not pile up
                    pub.recv_multipart()
            except Exception:  # a bug must not stop the thread: the engine would wait on a full queue
                self.errors += 1
                if self.errors == 1:
                    log.exception("kv events: batch %d was not published", seq)
            with self._done:
                self.done = seq + 1
                self._done.notify_all()
            self.encode_cpu_s += time.thread_time() - c0

    def _stalled(self, frames: tuple[bytes, bytes, bytes]) -> None:
        """A send was refused: past ``stall_timeout_ms`` of refusals, send this batch to the
        subscribers with room, and ZMQ sets the full queues aside."""
        now = time.monotonic()
        if self._refused_since is None:
            self._refused_since = now
        elif now - self._refused_since >= self.config.stall_timeout_ms / 1000:
            self.pub.setsockopt(zmq.XPUB_NODROP, 0)
            try:
                self.pub.send_multipart(frames, flags=zmq.NOBLOCK)
            finally:
                self.pub.setsockopt(zmq.XPUB_NODROP, 1)
            self.set_aside += 1
            self._refused_since = None

    # ---------------------------------------------------------------- replay thread
    def _serve_replays(self, wake: zmq.Socket) -> None:
        router = self.router
        poller = zmq.Poller()
        poller.register(wake, zmq.POLLIN)
        poller.register(router, zmq.POLLIN)
        try:
            while True:
                ready = dict(poller.poll())
                if wake in ready:
                    return
                if router in ready:
                    self._replay(router)
        except zmq.ContextTerminated:  # close() gave up waiting for the thread
            return
        finally:
            wake.close(linger=0)

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
            self.sync(5.0)  # every batch published before the request, so a replay ends current
            for seq, payload in tuple(self.buffer):  # one C call: no append interleaves it
                if seq >= first:
                    router.send_multipart((client, b"", seq.to_bytes(8, "big"), payload))
            router.send_multipart((client, b"", END_SEQ, b""))

    def stats(self) -> dict[str, int | float]:
        buffered = tuple(self.buffer)
        return {"batches": self.seq, "dropped": self.dropped, "set_aside": self.set_aside, "replays": self.replays,
                "errors": self.errors,
                "buffered": len(buffered), "buffered_bytes": sum(len(p) for _, p in buffered),
                "encode_cpu_us_mean": round(1e6 * self.encode_cpu_s / max(self.done, 1), 2)}

    def close(self) -> None:
        """Send what was handed over, stop both threads and close every socket."""
        if self._thread is not None and self._thread.is_alive():
            self._queue.put(_STOP)
            self._thread.join(timeout=10.0)
        if self._replayer is not None and self._replayer.is_alive():
            self._wake.send(b"")
            self._replayer.join(timeout=5.0)
        if self._wake is not None:
            self._wake.close(linger=0)
        self.pub.close(linger=1000)  # up to 1 s to hand connected subscribers the last batches
        self.ctx.destroy(linger=0)

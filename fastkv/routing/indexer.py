"""A reference KV-event indexer: which engine holds which block keys, per tier.

It subscribes to several engines' KV event streams (fastkv.events, or any vLLM-format
publisher), applies each engine's batches in sequence order and keeps, per engine and per
medium ("GPU", "CPU", "DISK"), the set of keys held. ``longest_prefix`` answers, for a
prompt's block keys (fastkv.routing.block_hashes), how many leading blocks each engine holds
in each tier, and the run an engine would serve from its tiers together (device, then host,
then storage: the engine's own match order).

Sequence numbers: a batch past the next expected one means batches were lost (the engine
dropped them from the live stream, the PUB socket dropped them for a slow subscriber, or the
subscriber joined late); the indexer asks the engine's replay socket for everything from the
first missing one and applies it in order. What the engine no longer buffers cannot come
back: ``lost`` counts those batches, and that engine's sets may then be stale until its next
AllBlocksCleared.

Every schema decodes (fastkv.events.schema): array events ``[tag, ...]`` (``llm-d``,
``vllm-array``) and tagged-map events ``{"type": tag, ...}`` (``vllm``), in an array batch (or a
map batch, which no schema sends).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

import msgspec
import zmq

MEDIA = ("GPU", "CPU", "DISK")
END_SEQ = -1


class Prefix(NamedTuple):
    """Leading blocks of a prompt an engine holds: per tier alone, and across its tiers."""

    gpu: int
    cpu: int
    disk: int
    total: int  # device run, then host run, then storage run (the engine's match order)


@dataclass
class EngineView:
    """One engine's keys per medium, and where its stream stands."""

    name: str
    held: dict[str, set] = field(default_factory=lambda: {m: set() for m in MEDIA})
    next_seq: int = 0
    batches: int = 0
    gaps: int = 0  # holes seen in the live stream (each answered by a replay)
    lost: int = 0  # batches the engine no longer buffered when replay asked for them
    clears: int = 0

    def apply(self, batch: object) -> None:
        events = batch["events"] if isinstance(batch, dict) else batch[1]
        for ev in events:
            if isinstance(ev, dict):
                tag = ev["type"]
                hashes = ev.get("block_hashes")
                medium = ev.get("medium")
            else:
                tag = ev[0]
                hashes = ev[1] if len(ev) > 1 else None
                medium = (ev[6] if len(ev) > 6 else None) if tag == "BlockStored" else (ev[2] if len(ev) > 2 else None)
            if tag == "AllBlocksCleared":
                self.clears += 1
                for keys in self.held.values():
                    keys.clear()
                continue
            keys = self.held.setdefault(medium or "GPU", set())  # vLLM: no medium is the GPU
            if tag == "BlockStored":
                keys.update(hashes)
            elif tag == "BlockRemoved":
                keys.difference_update(hashes)
        self.batches += 1

    def prefix(self, hashes: list) -> Prefix:
        runs = []
        for m in MEDIA:
            keys, n = self.held.get(m, ()), 0
            for h in hashes:
                if h not in keys:
                    break
                n += 1
            runs.append(n)
        total = 0
        for m in MEDIA:  # the cascade: a block counts from the fastest tier that has it
            keys = self.held.get(m, ())
            while total < len(hashes) and hashes[total] in keys:
                total += 1
        return Prefix(runs[0], runs[1], runs[2], total)


class Subscription:
    """One engine's SUB socket and replay DEALER."""

    def __init__(self, ctx: zmq.Context, view: EngineView, endpoint: str, replay_endpoint: str = "",
                 topic: str = "", replay_timeout_s: float = 5.0) -> None:
        self.view = view
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.sub.rcvhwm = 0  # the indexer, not ZMQ, decides what to drop (nothing)
        self.sub.connect(endpoint)
        self.replay_endpoint = replay_endpoint
        self.dealer = None
        if replay_endpoint:
            self.dealer = ctx.socket(zmq.DEALER)
            self.dealer.connect(replay_endpoint)
        self.timeout_ms = int(replay_timeout_s * 1000)
        self._decode = msgspec.msgpack.Decoder().decode

    def on_message(self, frames: list[bytes]) -> None:
        if len(frames) != 3:
            return
        seq = int.from_bytes(frames[1], "big")
        v = self.view
        if seq < v.next_seq:
            return  # already applied from a replay
        if seq > v.next_seq:
            v.gaps += 1
            self.replay()
            if seq < v.next_seq:
                return
            if seq > v.next_seq:  # the replay did not reach it: lost for good
                v.lost += seq - v.next_seq
        v.apply(self._decode(frames[2]))
        v.next_seq = seq + 1

    def replay(self) -> int:
        """Ask the engine for every batch from the next expected one; apply them in order.
        Returns how many were applied."""
        if self.dealer is None:
            return 0
        v = self.view
        self.dealer.send_multipart((b"", v.next_seq.to_bytes(8, "big")))
        applied = 0
        while True:
            if not self.dealer.poll(self.timeout_ms):
                raise TimeoutError(f"engine {v.name!r}: no replay answer from {self.replay_endpoint} "
                                   f"within {self.timeout_ms} ms")
            frames = self.dealer.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == END_SEQ:
                return applied
            if seq < v.next_seq:
                continue
            if seq > v.next_seq:
                v.lost += seq - v.next_seq
            v.apply(self._decode(frames[-1]))
            v.next_seq = seq + 1
            applied += 1

    def close(self) -> None:
        self.sub.close(linger=0)
        if self.dealer is not None:
            self.dealer.close(linger=0)


class Indexer:
    """Subscribes to engines (``add``) and answers longest cached prefixes."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.engines: dict[str, Subscription] = {}
        self.poller = zmq.Poller()
        self._by_socket: dict[zmq.Socket, Subscription] = {}

    def add(self, name: str, endpoint: str, replay_endpoint: str = "", topic: str = "") -> EngineView:
        if name in self.engines:
            raise ValueError(f"engine {name!r} is already subscribed")
        sub = Subscription(self.ctx, EngineView(name), endpoint, replay_endpoint, topic)
        self.engines[name] = sub
        self._by_socket[sub.sub] = sub
        self.poller.register(sub.sub, zmq.POLLIN)
        return sub.view

    def view(self, name: str) -> EngineView:
        return self.engines[name].view

    def poll(self, timeout_s: float = 0.0) -> int:
        """Apply what arrived, waiting up to ``timeout_s`` for the first message. Returns the
        number of messages taken."""
        n = 0
        ready = dict(self.poller.poll(int(timeout_s * 1000)))
        while ready:
            for sock in ready:
                sub = self._by_socket[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(flags=zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    sub.on_message(frames)
                    n += 1
            ready = dict(self.poller.poll(0))
        return n

    def sync(self, name: str | None = None) -> None:
        """Take what arrived, then replay every engine's (or ``name``'s) tail: after this the
        indexer has every batch the engines had published when it was called."""
        self.poll(0)
        for sub in ([self.engines[name]] if name else self.engines.values()):
            sub.replay()

    def longest_prefix(self, hashes: list) -> dict[str, Prefix]:
        """Per engine, the leading blocks of ``hashes`` it holds (fastkv.routing.block_hashes)."""
        return {name: sub.view.prefix(hashes) for name, sub in self.engines.items()}

    def close(self) -> None:
        for sub in self.engines.values():
            sub.close()
        self.ctx.destroy(linger=0)

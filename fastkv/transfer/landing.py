"""The engine's view of layered SWAP_INs (layer-wise loading, ``fastkv.ipc.landed``).

The client numbers each SWAP_IN in submit order (the order every rank's swap lane runs them) and
sends the number as ``TaskMsg.layered``. A rank acks one once its host bytes are verified, before
it copies; the copy then lands layer by layer. Until every rank that acked it shows it landed on
its counter, its destination blocks are still being written: a step that holds any of them in a
block table (the request the copy is for, or any other that hit or got those blocks meanwhile)
must wait, layer by layer, for it on those ranks. ``wait_for`` names, per rank, the task a plan's
layers wait for; a plan that touches no landing block waits for nothing, so a copy never delays
the steps of requests it is not for.
"""
from __future__ import annotations

import numpy as np

from fastkv.ipc.landed import Landed, slot
from fastkv.ipc.signals import SignalArray


class LandingCopies:
    def __init__(self, tp: int, layers: int, signals: SignalArray | None) -> None:
        self.tp, self.layers, self.signals = tp, layers, signals
        self.numbered = 0  # layered SWAP_INs sent (the last number given)
        self.acked = [0] * tp  # per rank, the highest number it acked ok
        self._sent: dict[int, tuple[int, np.ndarray, np.ndarray]] = {}  # task id -> (number, src, dst), until complete
        # number -> (src, dst, ranks that acked it ok), until it landed on each of them
        self._landing: dict[int, tuple[np.ndarray, np.ndarray, set[int]]] = {}

    def number(self, task_id: int, src: np.ndarray, dst: np.ndarray) -> int:
        self.numbered += 1
        self._sent[task_id] = (self.numbered, src, dst)
        return self.numbered

    def on_ack(self, task_id: int, rank: int, ok: bool) -> None:
        sent = self._sent.get(task_id)
        if sent is None or not ok:  # a rank that failed it posted it whole: nothing of it lands there
            return
        n, src, dst = sent
        self.acked[rank] = max(self.acked[rank], n)
        self._landing.setdefault(n, (src, dst, set()))[2].add(rank)

    def on_complete(self, task_id: int) -> bool:
        """The task is done (every rank acked or failed it); whether it was a layered one."""
        return self._sent.pop(task_id, None) is not None

    def _landed(self, n: int, rank: int) -> bool:
        return self.signals[slot(rank)] >= Landed.mark_of(n, self.layers - 1, self.layers)

    def wait_for(self, tables: list[np.ndarray]) -> np.ndarray | None:
        """Per rank, the layered task a step with these block tables waits for (0: none); None
        when it waits for nothing."""
        for n in [n for n, (_, _, ranks) in self._landing.items() if all(self._landed(n, r) for r in ranks)]:
            del self._landing[n]
        if not self._landing or not tables:
            return None
        blocks = np.concatenate(tables)
        out = np.zeros(self.tp, np.int64)
        for n, (_, dst, ranks) in self._landing.items():
            if np.isin(dst, blocks).any():
                for r in ranks:
                    if not self._landed(n, r):
                        out[r] = max(out[r], n)
        return out if out.any() else None

    def torn(self, rank: int) -> list[tuple[int, np.ndarray, np.ndarray]]:
        """(number, src, dst) of each layered copy ``rank`` acked and has not landed whole: what
        its process left half done when it went down. Its successor copies them again, first
        (``TransferClient``): nothing else ran on that rank since, so their host blocks still hold
        the verified bytes, and every step that holds one of their device blocks still waits."""
        return [(n, src, dst) for n, (src, dst, ranks) in sorted(self._landing.items())
                if rank in ranks and not self._landed(n, rank)]

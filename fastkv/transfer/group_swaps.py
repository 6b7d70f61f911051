"""A sliding-window hybrid's swaps: per KV cache group its own host segment and swap op.

A hybrid's groups have device tensors of different block counts, and their blocks have ids of
their own (``fastkv.cache.group_manager``), so a group's SWAP (``CopyPlan.group``) moves that
group's layers only, between its device tensors and its host segment
(``HostTier`` ``group``: ``[blocks, group's layers, 2, ...]``, with its checksums). Each group
binds the existing swap op over its own tensors (``ops.BoundSwap``: one block count for all its
layers, which holds within a group). Storage and weight updates are refused for a hybrid at
start-up, so only swaps come here.
"""
from __future__ import annotations

from collections.abc import Callable

from fastkv.cache.plan import CopyKind, CopyPlan
from fastkv.run import RunSpec
from fastkv.transfer.tiers import DeviceTier, HostTier


class GroupSwaps:
    """One rank's per-group host segments (attached here, created by the supervisor) and the
    swap op bound to each group's tensors (made on the group's first swap)."""

    def __init__(self, spec: RunSpec, rank: int) -> None:
        self.layout = spec.layout
        self.hosts: list[HostTier] = []
        try:
            for g, layout, n in spec.host_tiers():
                self.hosts.append(HostTier.attach(spec.tier_prefix, rank, layout, n, populate=True, group=g))
        except BaseException:
            self.close()
            raise
        self._bound: list = [None] * len(self.hosts)

    def unbind(self) -> None:
        """The device mapping the bound ops point into goes (``TaskExecutor._drop_device``)."""
        self._bound = [None] * len(self.hosts)

    def close(self) -> None:
        self.unbind()
        for host in self.hosts:
            host.close()
        self.hosts = []

    def swap(self, device: DeviceTier, plan: CopyPlan, *, threads: int, checksums: bool,
             in_parts: Callable, check_ids: Callable, check_host: Callable[[HostTier, list[int]], None]) -> int:
        """Runs one group's SWAP_OUT or SWAP_IN (as ``TaskExecutor._swap`` does the all-full
        layout's: ids checked first, host bytes checked before they leave, sealed as they land);
        returns the bytes moved."""
        g = plan.group
        if not 0 <= g < len(self.hosts):
            raise ValueError(f"{plan.kind.name} of KV cache group {g}: this run has {len(self.hosts)} groups")
        host, layers = self.hosts[g], self.layout.groups[g].layers
        ndev, nhost = device.layer_blocks[layers[0]], host.num_blocks
        out = plan.kind is CopyKind.SWAP_OUT
        check_ids(plan.src, ndev if out else nhost, f"group {g} src")
        check_ids(plan.dst, nhost if out else ndev, f"group {g} dst")
        if len(set(plan.dst.tolist())) != len(plan.dst):
            raise ValueError(f"{plan.kind.name} dst block ids must be unique, got {plan.dst.tolist()[:16]}")
        bound = self._bound[g]
        if bound is None:
            from fastkv.kernels import ops

            bound = self._bound[g] = ops.BoundSwap([device.k[i] for i in layers],
                                                   [device.v[i] for i in layers] if device.v else [],
                                                   host.tensor, hold_gil=True)
        sums = host.checksums if out and checksums else None
        unsealed: list[int] = []

        def part(p: slice) -> None:
            if not out and checksums:  # host bytes that changed since they landed never reach the device
                check_host(host, plan.src[p].tolist())
            if not bound.swap(plan.src[p], plan.dst[p], to_host=out, num_threads=threads, sums=sums) \
                    and sums is not None:
                unsealed.extend(plan.dst[p].tolist())

        in_parts(len(plan.src), part)
        if unsealed:
            host.seal(unsealed)
        return len(plan.src) * host.layout.block_bytes

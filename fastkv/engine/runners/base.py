"""The model-runner contract every worker rank implements.

A runner owns no memory of its own for KV: it is handed, per layer, the K and V tensors of
its rank's shard of the device tier (``layout.device_shape(num_device_blocks)``), which live
in shared memory that the transfer process of the same rank reads and writes. ``step``
writes the K/V of the new tokens of every sequence into their slots and returns the greedy
next token of every sequence with ``sample=True``. A runner touches only the slots of the
new tokens: every other slot may belong to another request or be in flight to another tier.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from fastkv.config import KVLayout
from fastkv.sched.output import StepOutput, StepPlan

# Paddle's name for each layout dtype. A uint16 numpy buffer exported through DLPack
# arrives in Paddle labelled bfloat16, so both spellings are accepted for bfloat16.
_PADDLE_DTYPES = {
    "float32": ("float32",),
    "float16": ("float16",),
    "bfloat16": ("bfloat16", "uint16"),
    "uint8": ("uint8",),
    "int8": ("int8",),
}


def host_view(tensor: Any) -> np.ndarray | None:
    """A zero-copy numpy view of a host-resident tensor (numpy array or CPU Paddle tensor).

    Returns None for a tensor on an accelerator. The view aliases the tensor's memory, so
    writes through it land in the shared buffer (Paddle's own setitem may or may not copy,
    depending on the indexing path; numpy's never does).
    """
    if isinstance(tensor, np.ndarray):
        return tensor
    if not tensor.place.is_cpu_place():
        return None
    from fastkv.transfer.tiers import paddle_to_numpy  # bfloat16 has no numpy dtype: its bits as uint16

    view = paddle_to_numpy(tensor)
    assert view.ctypes.data == tensor.data_ptr(), "np.from_dlpack copied a CPU Paddle tensor"
    return view


def _dtype_name(tensor: Any) -> str:
    if isinstance(tensor, np.ndarray):
        return {np.dtype(np.uint16): "bfloat16"}.get(tensor.dtype, tensor.dtype.name)
    return str(tensor.dtype).removeprefix("paddle.")


class ModelRunner(ABC):
    """One tensor-parallel rank's model runner.

    Constructed with the rank's ``KVLayout``, its ``rank`` in ``[0, tp_size)``, and per-layer
    lists of K and V cache tensors of shape ``layout.device_shape(num_device_blocks)`` (an MLA
    layout: the latents as K, and no V)
    (Paddle tensors, or numpy arrays for runners that never compute in Paddle).

    Layer-wise loading: a runner with ``layerwise = True`` calls ``wait_layer(plan, l)`` before
    layer l writes or reads any KV; the worker then starts its step while host -> device copies
    the step needs are still landing, layer by layer. Otherwise the worker waits for those
    copies whole before ``step``.
    """

    layerwise = False
    _layer_wait: Callable[[int, int], float] | None = None  # set by the worker (``bind_layer_wait``)

    def __init__(
        self, layout: KVLayout, rank: int, tp_size: int, k_caches: Sequence[Any], v_caches: Sequence[Any]
    ) -> None:
        if not isinstance(layout, KVLayout):
            raise TypeError(f"layout must be a KVLayout, got {type(layout).__name__}")
        if layout.tp_size != tp_size:
            raise ValueError(f"tp_size {tp_size} disagrees with layout.tp_size {layout.tp_size}")
        if not 0 <= rank < tp_size:
            raise ValueError(f"rank must be in [0, {tp_size}), got {rank}")
        self.layout = layout
        self.rank = rank
        self.tp_size = tp_size
        self.set_caches(k_caches, v_caches)

    def set_caches(self, k_caches: Sequence[Any], v_caches: Sequence[Any]) -> None:
        """(Re)bind the per-layer caches: at construction, and when the worker re-created its
        device tier after a weight update that freed it."""
        layout = self.layout
        v_layers = layout.num_layers if layout.kv_pages == 2 else 0  # MLA: the latents in k_caches, no V
        if len(k_caches) != layout.num_layers or len(v_caches) != v_layers:
            what = "K and V caches" if v_layers else "latent caches and no V"
            raise ValueError(
                f"need {layout.num_layers} {what} (one per layer), got {len(k_caches)} and {len(v_caches)}"
            )
        shape0 = tuple(k_caches[0].shape)
        if len(shape0) != 4 or shape0 != layout.device_shape(shape0[0]):
            raise ValueError(f"cache shape {shape0} is not layout.device_shape(n) = {layout.device_shape(0)[1:]}")
        # a hybrid's KV cache groups may differ in blocks: every layer has its group's first layer's
        first_of = {layer: g.layers[0] for g in layout.groups for layer in g.layers}
        for i, cache in enumerate([*k_caches, *v_caches]):
            layer = i % layout.num_layers
            which = f"{'KV'[i // layout.num_layers]} cache of layer {layer}"
            want = layout.device_shape(k_caches[first_of[layer]].shape[0])
            if tuple(cache.shape) != want:
                raise ValueError(f"{which} has shape {tuple(cache.shape)}, expected {want}")
            if _dtype_name(cache) not in _PADDLE_DTYPES[layout.dtype]:
                raise ValueError(f"{which} has dtype {_dtype_name(cache)}, layout says {layout.dtype}")
        # per KV cache group its device blocks; validate_plan checks a hybrid's tables against them
        self.group_blocks = tuple(int(k_caches[g.layers[0]].shape[0]) for g in layout.groups)
        self.kv_groups = layout.groups if layout.is_hybrid else ()
        self.num_device_blocks = max(self.group_blocks)
        self.k_caches = list(k_caches)
        self.v_caches = list(v_caches)
        # Zero-copy host views (None on an accelerator): the in-place write path.
        self.k_views = [host_view(c) for c in self.k_caches]
        self.v_views = [host_view(c) for c in self.v_caches]

    def bind_layer_wait(self, wait: Callable[[int, int], float] | None) -> None:
        """``wait(task, layer)`` blocks until layer ``layer`` of layered copy ``task`` landed
        on this rank (``fastkv.ipc.landed``); the worker binds it."""
        self._layer_wait = wait

    def wait_layer(self, plan: StepPlan, layer: int) -> float:
        """Blocks until layer ``layer`` of the KV ``plan`` reads has landed; the seconds waited."""
        if not plan.wait_landed or self._layer_wait is None:
            return 0.0
        return self._layer_wait(plan.wait_landed, layer)

    def drop_caches(self) -> None:
        """Let go of every reference to the caches (their memory is about to be freed); no
        step runs until ``set_caches``."""
        self.k_caches, self.v_caches, self.k_views, self.v_views = [], [], [], []

    def load_weights(self, weights_version: str) -> None:
        """Load the weights of ``weights_version`` (the weight-update hook; the caches' contents
        are dead by then). A runner that cannot reload raises: the update fails loudly."""
        raise NotImplementedError(f"{type(self).__name__} cannot load new weights")

    @abstractmethod
    def step(self, plan: StepPlan) -> StepOutput:
        """Compute one step: write the new tokens' K/V, return greedy next tokens of sampled seqs."""

    def checks(self) -> dict[str, int]:
        """What this runner verified so far (keys from ``fastkv.run.VERIFY_COUNTERS``); empty
        for a runner that checks nothing beyond computing from its KV."""
        return {}

    def release(self, request_ids: Iterable[int]) -> None:  # noqa: B027 - optional hook, stateless runners ignore it
        """Forget per-request state of finished or aborted requests (a no-op for stateless runners)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources the runner owns (not the caches: their owner frees those)."""

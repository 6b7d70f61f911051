"""Shapes and sizes shared by every component.

``KVLayout`` is the one description of a rank's KV cache. The device tier holds, per
layer, a K and a V tensor ``[num_device_blocks, kv_heads, block_size, head_dim]``; the
host tier is block-major ``[num_host_blocks, num_layers, 2, kv_heads, block_size,
head_dim]`` so that one host block is one contiguous span (one write to storage).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# KV dtypes by name. bfloat16 has no numpy dtype: its bytes travel as uint16.
_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype(np.float32)),
    "float16": (2, np.dtype(np.float16)),
    "bfloat16": (2, np.dtype(np.uint16)),
    "uint8": (1, np.dtype(np.uint8)),
    "int8": (1, np.dtype(np.int8)),
}


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache of one tensor-parallel rank."""

    num_layers: int
    kv_heads: int  # per rank
    block_size: int  # tokens per block
    head_dim: int
    dtype: str = "bfloat16"
    tp_size: int = 1

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds this layout's bytes (uint16 for bfloat16)."""
        return _DTYPES[self.dtype][1]

    @property
    def page_elems(self) -> int:
        """Elements of one block of one layer's K (or V)."""
        return self.kv_heads * self.block_size * self.head_dim

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block across layers, K and V: one host block."""
        return self.num_layers * 2 * self.page_bytes

    def device_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.kv_heads, self.block_size, self.head_dim)

    def host_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.kv_heads, self.block_size, self.head_dim)

    def describe(self) -> str:
        """A canonical string of everything that changes the bytes of a block."""
        return (
            f"layers={self.num_layers};kv_heads={self.kv_heads};block={self.block_size};"
            f"head_dim={self.head_dim};dtype={self.dtype};tp={self.tp_size}"
        )

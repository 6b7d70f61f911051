"""Shapes and sizes shared by every component.

``KVLayout`` is the one description of a rank's KV cache. The device tier holds, per
layer, a K and a V tensor ``[num_device_blocks, kv_heads, block_size, head_dim]``; the
host tier is block-major ``[num_host_blocks, num_layers, 2, kv_heads, block_size,
head_dim]`` so that one host block is one contiguous span (one write to storage).

A quantized layout (``quant`` "fp8_e4m3" or "int8") keeps that addressing with a wider row:
each token-head row of a K (or V) page is ``head_dim`` one-byte values and then their float32
scale, ``head_dim + 4`` bytes of ``uint8``. The scales thus sit in the same page as the values
they scale, so every tier, the checksum and the swap ops carry them with their block as bytes.
``parts`` names what a row holds.

A layer attends over every earlier position (full attention) or only over the last ``w``
positions (a sliding window of ``w``): ``windows`` names each layer's (0: full). Layers of one
kind form a KV cache *group* (``groups``); a sliding group needs only its window's blocks.

An MLA layout (``mla``) has one page per layer, the latent (DeepSeek's compressed KV and its
rope dims, ``head_dim`` values per token, ``kv_heads`` 1), and no V: the device tier holds one
tensor per layer and a host block is ``[num_layers, 1, 1, block_size, head_dim]``. The latent is
the same on every tensor-parallel rank, so every rank holds all of it.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import NamedTuple

import numpy as np

# KV dtypes by name. bfloat16 has no numpy dtype: its bytes travel as uint16.
_DTYPES: dict[str, tuple[int, np.dtype]] = {
    "float32": (4, np.dtype(np.float32)),
    "float16": (2, np.dtype(np.float16)),
    "bfloat16": (2, np.dtype(np.uint16)),
    "uint8": (1, np.dtype(np.uint8)),
    "int8": (1, np.dtype(np.int8)),
}


# Quantized KV dtypes (``KVLayout.quant``): one byte per value, one float32 scale per token-head.
QUANT_DTYPES = ("fp8_e4m3", "int8")
SCALE_BYTES = 4
# --kv-layout's choices: a K and a V page per layer, or MLA's one latent page (``KVLayout.mla``).
KV_LAYOUTS = ("kv", "mla")
# --kv-cache-dtype's choices; "auto" keeps the job's ``dtype``.
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "float32", *QUANT_DTYPES)


@dataclass(frozen=True, slots=True)
class Part:
    """What one token-head row of a layer's K or V page holds at ``offset`` bytes: ``count``
    values of ``dtype``, named ``name`` (k, v, k_scale, v_scale)."""

    name: str
    page: int  # 0: the K page (MLA: the latent's), 1: the V page
    dtype: str
    count: int
    offset: int


def cdiv(a: int, b: int) -> int:
    """Ceiling division: how many blocks of ``b`` hold ``a`` tokens."""
    return -(-a // b)


class KVGroup(NamedTuple):
    """Layers of one attention kind: ``window`` 0 for full attention, else the sliding window."""

    window: int
    layers: tuple[int, ...]

    @property
    def kind(self) -> str:
        return "sliding_window" if self.window else "full_attention"

    def first_needed(self, num_tokens: int, block_size: int) -> int:
        """The first block the query at position ``num_tokens`` reads: it attends over
        [num_tokens - window + 1, num_tokens], so blocks wholly before are never read again."""
        if not self.window:
            return 0
        return max(0, num_tokens - self.window + 1) // block_size

    def max_blocks(self, block_size: int, chunk: int = 1) -> int | None:
        """The most blocks one request holds while a step computes ``chunk`` of its tokens
        (None: no bound, a full group holds its whole context)."""
        if not self.window:
            return None
        return cdiv(self.window - 1 + chunk, block_size) + 1

    def blocks_for(self, num_tokens: int, block_size: int) -> int:
        """Blocks a request of ``num_tokens`` tokens holds in this group between its steps."""
        n = cdiv(num_tokens, block_size)
        return n - self.first_needed(num_tokens, block_size) if self.window else n


def _windows_text(windows: tuple[int, ...]) -> str:
    """The shortest repeating pattern of ``windows`` and its count ("(128,0)x12"), or the list."""
    n = len(windows)
    for period in range(1, n + 1):
        if n % period == 0 and windows == windows[:period] * (n // period):
            return f"({','.join(map(str, windows[:period]))})x{n // period}"
    raise AssertionError("unreachable: the whole list is its own period")


@dataclass(frozen=True, slots=True)
class KVLayout:
    """The KV cache of one tensor-parallel rank."""

    num_layers: int
    kv_heads: int  # per rank
    block_size: int  # tokens per block
    head_dim: int
    dtype: str = "bfloat16"
    tp_size: int = 1
    quant: str = ""  # "": values of ``dtype``; else one of QUANT_DTYPES, with ``dtype`` "uint8"
    # per layer: 0 full attention, w > 0 a sliding window of w tokens; () every layer full
    windows: tuple[int, ...] = ()
    mla: bool = False  # one latent page per layer instead of K and V

    def __post_init__(self) -> None:
        for name in ("num_layers", "kv_heads", "block_size", "head_dim", "tp_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"KVLayout.{name} must be a positive int, got {value!r}")
        if self.dtype not in _DTYPES:
            raise ValueError(f"KVLayout.dtype must be one of {sorted(_DTYPES)}, got {self.dtype!r}")
        if self.quant and self.quant not in QUANT_DTYPES:
            raise ValueError(f"KVLayout.quant must be '' or one of {QUANT_DTYPES}, got {self.quant!r}")
        if self.quant and self.dtype != "uint8":
            raise ValueError(f"a quantized KVLayout holds bytes: dtype must be 'uint8', got {self.dtype!r}")
        windows = tuple(self.windows)  # a list from JSON (RunSpec) is the same layout
        if windows and len(windows) != self.num_layers:
            raise ValueError(f"KVLayout.windows must name each of the {self.num_layers} layers, got {len(windows)}")
        for w in windows:
            if not isinstance(w, int) or isinstance(w, bool) or w < 0:
                raise ValueError(f"KVLayout.windows must be ints >= 0 (0: full attention), got {w!r}")
        object.__setattr__(self, "windows", windows if any(windows) else ())  # all full: the default layout
        if not isinstance(self.mla, bool):
            raise ValueError(f"KVLayout.mla must be a bool, got {self.mla!r}")
        if self.mla and self.kv_heads != 1:
            raise ValueError(f"an MLA KVLayout holds one latent per token: kv_heads must be 1, got {self.kv_heads}")
        if self.mla and self.quant:
            raise ValueError(f"a quantized MLA latent is not supported, got quant={self.quant!r}")

    @classmethod
    def of(cls, kv_cache_dtype: str, **fields) -> KVLayout:
        """The layout of a ``--kv-cache-dtype`` other than auto (a float dtype or a quantized one)."""
        if kv_cache_dtype in QUANT_DTYPES:
            return cls(**fields, dtype="uint8", quant=kv_cache_dtype)
        return cls(**fields, dtype=kv_cache_dtype)

    @property
    def kv_cache_dtype(self) -> str:
        """The KV dtype by its user-facing name: the quantization, else ``dtype``."""
        return self.quant or self.dtype

    @property
    def row_elems(self) -> int:
        """Elements (of ``numpy_dtype``) of one token-head row: head_dim, plus the scale's bytes."""
        return self.head_dim + (SCALE_BYTES if self.quant else 0)

    @property
    def kv_pages(self) -> int:
        """Pages per layer in a block: K and V, or MLA's latent alone."""
        return 1 if self.mla else 2

    @property
    def parts(self) -> tuple[Part, ...]:
        """What a token-head row of each page holds, by name."""
        if self.mla:
            return (Part("latent", 0, self.dtype, self.head_dim, 0),)
        if not self.quant:
            return (Part("k", 0, self.dtype, self.head_dim, 0), Part("v", 1, self.dtype, self.head_dim, 0))
        d = self.head_dim
        return (Part("k", 0, self.quant, d, 0), Part("k_scale", 0, "float32", 1, d),
                Part("v", 1, self.quant, d, 0), Part("v_scale", 1, "float32", 1, d))

    def as_raw(self) -> KVLayout:
        """The same bytes as a plain layout (a quantized row as ``row_elems`` uint8 values): for a
        runner that writes bytes without reading them as numbers (the synthetic runner)."""
        if not self.quant:
            return self
        return KVLayout(self.num_layers, self.kv_heads, self.block_size, self.row_elems, "uint8", self.tp_size,
                        windows=self.windows)

    @property
    def bytes_per_token(self) -> int:
        """Bytes of one token's KV on this rank, scales included (what every tier and link moves)."""
        return self.block_bytes // self.block_size

    @property
    def groups(self) -> tuple[KVGroup, ...]:
        """The KV cache groups: layers of one window each, in order of their first layer."""
        if not self.windows:
            return (KVGroup(0, tuple(range(self.num_layers))),)
        layers: dict[int, list[int]] = {}
        for i, w in enumerate(self.windows):
            layers.setdefault(w, []).append(i)
        return tuple(KVGroup(w, tuple(ls)) for w, ls in layers.items())

    @property
    def is_hybrid(self) -> bool:
        """Some layer slides: the groups hold different blocks."""
        return bool(self.windows)

    def group_of(self, layer: int) -> int:
        """The index in ``groups`` of the group holding ``layer``."""
        for i, g in enumerate(self.groups):
            if layer in g.layers:
                return i
        raise ValueError(f"layer {layer} is not one of the {self.num_layers} layers")

    def layer_blocks(self, group_blocks: tuple[int, ...] | list[int], num_blocks: int) -> tuple[int, ...]:
        """Device blocks of each layer's K (and V) tensor: its group's in ``group_blocks``, or
        ``num_blocks`` for every layer when ``group_blocks`` is empty."""
        if not group_blocks:
            return (num_blocks,) * self.num_layers
        groups = self.groups
        if len(group_blocks) != len(groups) or any(not isinstance(n, int) or n <= 0 for n in group_blocks):
            raise ValueError(f"group_blocks must name a positive block count for each of the {len(groups)} "
                             f"KV cache groups, got {list(group_blocks)}")
        out = [0] * self.num_layers
        for g, n in zip(groups, group_blocks, strict=True):
            for layer in g.layers:
                out[layer] = n
        return tuple(out)

    def group_layout(self, index: int) -> KVLayout:
        """The layout of group ``index``'s layers alone: a hybrid's host tier holds one block-major
        section per group of this layout (``fastkv.transfer.tiers.HostTier``, ``group``)."""
        g = self.groups[index]
        return replace(self, num_layers=len(g.layers), windows=(g.window,) * len(g.layers))

    def group_block_bytes(self, group: KVGroup) -> int:
        """Bytes of one block of ``group``'s layers, every page (K and V, or the latent)."""
        return len(group.layers) * self.kv_pages * self.page_bytes

    def bytes_per_request(self, num_tokens: int) -> int:
        """KV bytes one request of ``num_tokens`` tokens holds between steps, over every group."""
        return sum(g.blocks_for(num_tokens, self.block_size) * self.group_block_bytes(g) for g in self.groups)

    @property
    def itemsize(self) -> int:
        return _DTYPES[self.dtype][0]

    @property
    def numpy_dtype(self) -> np.dtype:
        """The numpy dtype that holds this layout's bytes (uint16 for bfloat16)."""
        return _DTYPES[self.dtype][1]

    @property
    def page_elems(self) -> int:
        """Elements of one block of one layer's K (or V), its scales included."""
        return self.kv_heads * self.block_size * self.row_elems

    @property
    def page_bytes(self) -> int:
        return self.page_elems * self.itemsize

    @property
    def block_bytes(self) -> int:
        """Bytes of one whole block across layers, K and V (or the latent): one host block."""
        return self.num_layers * self.kv_pages * self.page_bytes

    def device_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.kv_heads, self.block_size, self.row_elems)

    def host_shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, self.kv_pages, self.kv_heads, self.block_size, self.row_elems)

    def describe(self) -> str:
        """A canonical string of everything that changes the bytes of a block."""
        return (
            f"layers={self.num_layers};kv_heads={self.kv_heads};block={self.block_size};"
            f"head_dim={self.head_dim};dtype={self.dtype};tp={self.tp_size}"
            + (f";quant={self.quant};scales=token_head_f32" if self.quant else "")
            + (f";windows={_windows_text(self.windows)}" if self.windows else "")
            + (";mla=latent" if self.mla else "")
        )

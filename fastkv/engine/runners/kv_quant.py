"""Quantized KV rows as a runner writes and reads them: one byte per value (fp8 e4m3 or int8)
and a float32 scale per token-head, packed as ``KVLayout.quant`` says (values, then the scale).

Scales are powers of two, at least ``min_scale``: dividing by one is exact, and a value on a
2^-b grid dequantizes back onto that grid (the tiny decoder's fixed-point arithmetic needs it;
an fp8 scale in hardware is a power of two too, E8M0 in the MX formats). fastkv itself moves the
bytes and never reads them: a runner with other scales packs them the same way.
"""
from __future__ import annotations

import numpy as np

from fastkv.config import SCALE_BYTES

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}
# The smallest step between codes: a value that is a multiple of this (after scaling) is exact.
QUANTUM = {"int8": 1.0, "fp8_e4m3": 2.0**-9}


def _fp8_table() -> np.ndarray:
    """The float64 value of each e4m3fn byte (0x7F and 0xFF are NaN)."""
    b = np.arange(256)
    sign = np.where(b & 0x80, -1.0, 1.0)
    e, m = (b >> 3) & 0xF, (b & 7).astype(np.float64)
    mag = np.where(e == 0, m * 2.0**-9, np.ldexp(1.0 + m / 8, e - 7))
    return np.where((b & 0x7F) == 0x7F, np.nan, sign * mag)


FP8_VALUES = _fp8_table()
_FP8_POSITIVE = FP8_VALUES[:0x7F]  # ascending: 0, the subnormals, ..., 448


def _round_fp8(y: np.ndarray) -> np.ndarray:
    """Round to the nearest e4m3 value, ties to even (|y| <= 448)."""
    a = np.abs(y)
    _, e = np.frexp(a)  # a = f * 2^e, f in [0.5, 1): floor(log2 a) = e - 1
    quantum = np.ldexp(1.0, np.maximum(e - 1, -6) - 3)
    return np.copysign(np.round(a / quantum) * quantum, y)


def scales(x: np.ndarray, kind: str, min_scale: float) -> np.ndarray:
    """The power-of-two scale of each row of ``x`` [..., D] (keepdims): its max |x| fits QMAX."""
    ratio = np.abs(x).max(axis=-1, keepdims=True) / QMAX[kind]
    f, e = np.frexp(ratio)
    return np.maximum(np.ldexp(1.0, np.where(f == 0.5, e - 1, e)), min_scale)


def quantize(x: np.ndarray, kind: str, min_scale: float) -> np.ndarray:
    """Rows [..., D] of float -> packed rows [..., D + 4] uint8: codes, then the float32 scale."""
    x = np.asarray(x, np.float64)
    scale = scales(x, kind, min_scale)
    y = x / scale
    if kind == "int8":
        codes = np.clip(np.round(y), -127, 127).astype(np.int8).view(np.uint8)
    else:
        r = _round_fp8(y)
        codes = (np.searchsorted(_FP8_POSITIVE, np.abs(r)) | np.where(r < 0, 0x80, 0)).astype(np.uint8)
    scale_bytes = scale.astype(np.float32).view(np.uint8)
    assert scale_bytes.shape[-1] == SCALE_BYTES
    return np.concatenate([codes, scale_bytes], axis=-1)


def dequantize(rows: np.ndarray, kind: str) -> np.ndarray:
    """Packed rows [..., D + 4] uint8 -> float64 [..., D]."""
    codes = rows[..., :-SCALE_BYTES]
    scale = np.ascontiguousarray(rows[..., -SCALE_BYTES:]).view(np.float32).astype(np.float64)
    values = codes.view(np.int8).astype(np.float64) if kind == "int8" else FP8_VALUES[codes]
    return values * scale


def fake_quantize(x: np.ndarray, kind: str, min_scale: float) -> np.ndarray:
    """What a row reads back after it was written: the cache-free reference's K and V."""
    return dequantize(quantize(x, kind, min_scale), kind)

"""Quantized KV rows: fp8 e4m3 codes as the format defines them, power-of-two scales packed after the values."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.engine.runners.kv_quant import FP8_VALUES, QMAX, dequantize, quantize


def test_fp8_codes_are_e4m3fn():
    ml_dtypes = pytest.importorskip("ml_dtypes")
    want = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    np.testing.assert_array_equal(FP8_VALUES, want)
    x = np.random.default_rng(0).uniform(-448, 448, 4096)
    x[:4] = [0.0, 2.0**-10, 3 * 2.0**-10, 448.0]  # a tie to even in the subnormals, the largest value
    rows = quantize(x[None, :], "fp8_e4m3", 1.0)
    assert rows[0, -4:].view(np.float32)[0] == 1.0
    np.testing.assert_array_equal(FP8_VALUES[rows[0, :-4]], x.astype(ml_dtypes.float8_e4m3fn).astype(np.float64))


@pytest.mark.parametrize("kind", ["fp8_e4m3", "int8"])
def test_rows_pack_codes_then_a_power_of_two_scale(kind):
    rng = np.random.default_rng(1)
    x = np.round(rng.standard_normal((5, 3, 16)) * rng.uniform(0.01, 200, (5, 3, 1)) * 4096) / 4096
    rows = quantize(x, kind, 2.0**-12)
    assert rows.dtype == np.uint8 and rows.shape == (5, 3, 20)
    scale = rows[..., 16:].copy().view(np.float32)[..., 0]
    assert np.all(np.frexp(scale)[0] == 0.5), "scales are powers of two"
    amax = np.abs(x).max(-1)
    assert np.all(amax <= QMAX[kind] * scale) and np.all(amax > QMAX[kind] * scale / 2)
    back = dequantize(rows, kind)
    y = np.abs(x / scale[..., None])
    step = scale[..., None] * (1 if kind == "int8" else 2.0 ** (np.floor(np.log2(np.maximum(y, 2.0**-6))) - 3))
    assert np.all(np.abs(back - x) <= step / 2), "each value rounds to a nearest code"
    np.testing.assert_array_equal(quantize(back, kind, 2.0**-12), rows)  # rounding twice changes nothing

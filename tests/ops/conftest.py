"""Shared fixtures of the op tests: the ops are built (or found in the build cache) once per session."""
from __future__ import annotations

import numpy as np
import pytest

from fastkv.config import KVLayout
from tests.optional import require_paddle


@pytest.fixture(scope="session")
def paddle_ops():
    """Paddle with fastkv's ops registered; skips (fails under CI) where Paddle is not installed."""
    paddle = require_paddle()
    from fastkv.kernels import ops

    ops.load()  # JIT build under a file lock on the first run, then the cache
    return paddle


class Tiers:
    """A device and a host tier over plain numpy arrays, with Paddle tensors over the same bytes."""

    def __init__(self, layout: KVLayout, num_dev: int, num_host: int, rng: np.random.Generator) -> None:
        from fastkv.transfer.tiers import numpy_to_paddle

        self.layout = layout

        def random_array(shape):
            nbytes = int(np.prod(shape)) * layout.itemsize
            return rng.integers(0, 256, nbytes, dtype=np.uint8).view(layout.numpy_dtype).reshape(shape)

        self.k = [random_array(layout.device_shape(num_dev)) for _ in range(layout.num_layers)]
        v_layers = layout.num_layers if layout.kv_pages == 2 else 0  # MLA: no V
        self.v = [random_array(layout.device_shape(num_dev)) for _ in range(v_layers)]
        self.host = random_array(layout.host_shape(num_host))
        self.k_t = [numpy_to_paddle(a, layout.dtype) for a in self.k]
        self.v_t = [numpy_to_paddle(a, layout.dtype) for a in self.v]
        self.host_t = numpy_to_paddle(self.host, layout.dtype)

    def snapshot(self) -> list[np.ndarray]:
        return [a.copy() for a in (*self.k, *self.v, self.host)]

    def arrays(self) -> list[np.ndarray]:
        return [*self.k, *self.v, self.host]

    def assert_bytes_equal(self, expected: list[np.ndarray]) -> None:
        for i, (got, want) in enumerate(zip(self.arrays(), expected, strict=True)):
            # Bytes, not values: NaN payloads and -0.0 must survive a swap too.
            assert np.array_equal(got.view(np.uint8), want.view(np.uint8)), f"array {i} differs from the reference"

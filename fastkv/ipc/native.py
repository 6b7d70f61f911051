"""The compiled helpers, with a clear message when they have not been built:
``fastkv._atomics`` (ops/shm_atomics.c: atomics, fences, the ring fast path) and
``fastkv._codec`` (ops/ipc_codec.c: the message codec's fast path)."""
from __future__ import annotations

try:
    from fastkv import _atomics as A  # noqa: N812  (short names: used on every hot-path call)
    from fastkv import _codec as C  # noqa: N812
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        f"fastkv's C extensions are not built ({exc}). Install fastkv with `pip install -e .`, "
        "or build them in place with `python setup.py build_ext --inplace` in the repository root."
    ) from exc

__all__ = ["A", "C"]

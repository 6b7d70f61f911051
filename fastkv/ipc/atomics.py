"""The compiled atomics (``fastkv._atomics``, from ops/shm_atomics.c), with a clear message
when the extension has not been built."""
from __future__ import annotations

try:
    from fastkv import _atomics as A  # noqa: N812  (short name: used on every hot-path call)
except ImportError as exc:  # pragma: no cover - depends on the build
    raise ImportError(
        "fastkv._atomics (the shared-memory atomics extension, ops/shm_atomics.c) is not built. "
        "Install fastkv with `pip install -e .` or build it in place with "
        "`python setup.py build_ext --inplace` in the repository root."
    ) from exc

__all__ = ["A"]

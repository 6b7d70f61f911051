"""The GPU architectures fastkv's CUDA code is compiled for, as nvcc ``-gencode`` flags.

Both builds use them: the Paddle op's JIT build (``fastkv.kernels.ops``; Paddle's own JIT passes none, so
nvcc would build for its default architecture and a newer GPU would JIT the PTX at every first
load) and the C ABI library (``fastkv.kernels.cuda_abi``). ``FASTKV_CUDA_ARCH`` overrides the list:
compute capabilities separated by commas, spaces or semicolons, as ``80``, ``8.0`` or ``90a``; ``+PTX``
after one also embeds its PTX, which newer GPUs JIT. Default: ``80,90+PTX`` (A100, H100/H200).
"""
from __future__ import annotations

import os
import re

ENV = "FASTKV_CUDA_ARCH"
DEFAULT = "80,90+PTX"

# 80, 8.0, 100, 10.0; an arch-specific variant as 90a; +PTX after any
_ENTRY = re.compile(r"(?:(\d{1,2})\.(\d)|(\d{2,3}))([af]?)(\+PTX)?", re.IGNORECASE)


def gencode_flags(spec: str | None = None) -> tuple[str, ...]:
    """The -gencode flags of ``spec`` (default: $FASTKV_CUDA_ARCH, else ``DEFAULT``); a bad
    entry raises ValueError naming it."""
    from_env = spec is None and bool(os.environ.get(ENV))
    if spec is None:
        spec = os.environ.get(ENV) or DEFAULT
    what = f"{ENV}={spec!r}" if from_env else repr(spec)
    entries = [e for e in re.split(r"[,;\s]+", spec.strip()) if e]
    if not entries:
        raise ValueError(f"{what} names no architecture (e.g. {DEFAULT!r})")
    flags: list[str] = []
    for entry in entries:
        match = _ENTRY.fullmatch(entry)
        if match is None:
            raise ValueError(f"{what}: {entry!r} is not a compute capability like 80, 8.0 or 90+PTX")
        cc = (match[3] or match[1] + match[2]) + match[4].lower()
        flags.append(f"-gencode=arch=compute_{cc},code=sm_{cc}")
        if match[5]:
            flags.append(f"-gencode=arch=compute_{cc},code=compute_{cc}")
    return tuple(dict.fromkeys(flags))  # a repeated entry once


DEFAULT_FLAGS = gencode_flags(DEFAULT)

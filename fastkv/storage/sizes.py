"""Sizes as users write them in storage URLs and settings (``512M``, ``64G``).

Its own module: the URL factory and the Mooncake settings both parse sizes, and the factory
imports the Mooncake settings.
"""
from __future__ import annotations

import re

_SIZE = re.compile(r"^\s*(\d+)\s*([KMGT]?)(I?B)?\s*$", re.IGNORECASE)
_SHIFT = {"": 0, "K": 10, "M": 20, "G": 30, "T": 40}


def parse_size(text: str) -> int:
    """``"64G"`` -> 64 GiB in bytes."""
    m = _SIZE.match(text)
    if m is None:
        raise ValueError(f"not a size: {text!r} (expected e.g. 1048576, 512M, 64G)")
    return int(m.group(1)) << _SHIFT[m.group(2).upper()]

"""fastkv's C extensions (setup.py's ``ext_modules``), imported with one clear message when
they have not been built, as after a ``git pull`` that added one without ``pip install -e .``."""
from __future__ import annotations

import importlib
from types import ModuleType


class NotBuilt(ImportError):
    """A C extension of fastkv is missing from the installed package."""


def load(name: str) -> ModuleType:
    try:
        return importlib.import_module(f"fastkv.native.{name}")
    except ImportError as exc:
        raise NotBuilt(f"fastkv's C extension {name} is not built ({exc}); install fastkv with "
                       "`pip install -e .`, or build it in place with `python setup.py build_ext --inplace` in "
                       "the repository root") from exc

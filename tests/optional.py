"""One rule for every optional dependency of the tests (an extra, a server, a tool): missing, the
test skips and says how to install it; with ``CI`` set it FAILS instead, because .ci/run installs
every one of them and a skip there would hide a broken setup.

Called at a test module's top (before the imports that need the dependency) the skip or failure
covers the whole module, so a missing extra is a skip, never a collection error.
"""
from __future__ import annotations

import importlib
import os
import shutil
from types import ModuleType
from typing import NoReturn

import pytest

EVENTS = "pip install -e '.[events]'"
MOONCAKE = "pip install -e '.[mooncake]', apt-get install libibverbs1"
MODELS = "the models extra: .ci/install-models"
REDIS = "apt-get install redis-server"
PROMTOOL = "apt-get install prometheus"
PADDLE = "pip install -e '.[cpu]'"


def missing(what: str, install: str) -> NoReturn:
    """Skip (fail under CI): ``what`` is not installed, ``install`` gets it."""
    if os.environ.get("CI"):
        pytest.fail(f"{what} is not installed, but CI is set: .ci/run must install it ({install})", pytrace=False)
    pytest.skip(f"{what} is not installed ({install})", allow_module_level=True)


def require_module(name: str, install: str) -> ModuleType:
    """The module ``name``, or a skip (a failure under CI) when it does not import."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        missing(exc.name or name, install)


def require_binary(name: str, install: str) -> str:
    """The path of the program ``name``, or a skip (a failure under CI) when it is not on PATH."""
    path = shutil.which(name)
    if path is None:
        missing(name, install)
    return path


def require_events() -> None:
    """pyzmq and msgspec, the ``events`` extra."""
    require_module("msgspec", EVENTS)
    require_module("zmq", EVENTS)


def require_paddleformers() -> ModuleType:
    """PaddleFormers, the ``models`` extra."""
    return require_module("paddleformers", MODELS)


def require_paddle() -> ModuleType:
    """Paddle, the ``cpu`` extra (or a GPU build)."""
    return require_module("paddle", PADDLE)

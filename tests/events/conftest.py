"""KV event tests need pyzmq and msgspec (the ``events`` extra): missing, they skip locally but
FAIL when CI is set (.ci/run installs the extra, so a skip there would hide a broken setup)."""
from __future__ import annotations

import os

import pytest


def require_events() -> None:
    try:
        import msgspec  # noqa: F401
        import zmq  # noqa: F401
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(f"{exc.name} is not installed, but CI is set: .ci/run must install '.[events]'")
        pytest.skip(f"{exc.name} is not installed (pip install '.[events]')")


@pytest.fixture(autouse=True)
def _events_installed():
    require_events()

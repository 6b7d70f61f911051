from __future__ import annotations

import pytest

from fastkv.ipc import Namespace
from tests.ipc.helpers import run_objects


@pytest.fixture
def ns():
    """A fresh run namespace; asserts that closing it removes every object."""
    ns = Namespace.create()
    yield ns
    ns.close()
    assert run_objects(ns.run_id) == []

"""KV event tests need pyzmq and msgspec (the ``events`` extra): tests/optional.py's rule, skip
locally, fail under CI. Modules that import the extra at their top call ``require_events()``
there first; this fixture covers the others."""
from __future__ import annotations

import pytest

from tests.optional import require_events


@pytest.fixture(autouse=True)
def _events_installed():
    require_events()

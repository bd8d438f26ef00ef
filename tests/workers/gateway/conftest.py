"""The ``rig`` fixture: see gateway_rig.py."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.workers.gateway.gateway_rig import Rig, make_rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    yield from make_rig()

"""Fixtures shared by the test modules."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from test_gateway_fakes import LoopThread


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    """An asyncio loop in a thread for a test's in-process gateway and fake engines."""
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.stop()

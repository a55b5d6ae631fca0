"""Fixtures shared by the test modules."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# The tests are grouped in folders as the package is (tests/gateway/, tests/sim/, ...); a test
# module imports the fakes and scenarios of another by its module name, from any folder.
for _group in sorted(Path(__file__).parent.iterdir()):
    if _group.is_dir() and not _group.name.startswith((".", "_")) and _group.name != "data":
        sys.path.insert(0, str(_group))

from test_gateway_fakes import LoopThread  # noqa: E402

# pytest-xdist's workers (make test runs two) set COLUMNS=80 and LINES=24 for their children;
# off a terminal the CLI prints its tables 160 columns wide unless COLUMNS says otherwise
# (cli/common.py `console`), so the tests read the same output under either runner
for _name in ("COLUMNS", "LINES"):
    os.environ.pop(_name, None)


@pytest.fixture
def lt() -> Iterator[LoopThread]:
    """An asyncio loop in a thread for a test's in-process gateway and fake engines."""
    loop = LoopThread()
    try:
        yield loop
    finally:
        loop.stop()

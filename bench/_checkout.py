"""Run a snippet in a fresh Python process that imports another checkout's flexpipe (the
side-by-side comparisons of bench/sim_speed.py and bench/sim_fingerprint.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any


def run_child(checkout: Path, code: str, *args: str) -> dict[str, Any]:
    """Run `code` with `args` in `checkout` (on its PYTHONPATH); its last line of stdout is
    a JSON object, returned."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=checkout, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    row: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return row

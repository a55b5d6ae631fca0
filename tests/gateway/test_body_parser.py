"""The gateway's parser processes (gateway/body_parser.py) end with their gateway, however it
ends: a gateway killed with kill -9 leaves none behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# a stand-in for the gateway process: large bodies validated (the pool starts both of its
# processes), then idle
GATEWAY = """
import asyncio, orjson
from flexpipe.gateway.body_parser import PARSE_OFF_LOOP_BYTES, BodyParser

async def main() -> None:
    body = orjson.dumps({"model": "m", "prompt": "w" * (PARSE_OFF_LOOP_BYTES + 1)})
    parser = BodyParser()
    for _ in range(3):
        calls = [parser.summarize(body, "application/json", False, 64) for _ in range(4)]
        summaries = await asyncio.gather(*calls)
    print(summaries[0].model, flush=True)
    await asyncio.sleep(120)

if __name__ == "__main__":
    asyncio.run(main())
"""


def _children(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-o", "pid=", "--ppid", str(pid)], capture_output=True, text=True)
    return {int(p) for p in out.stdout.split()}


def _running(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state != "Z"  # a zombie has exited (its new parent has not reaped it yet)


def test_parser_processes_exit_when_their_gateway_is_killed(tmp_path: Path) -> None:
    script = tmp_path / "gateway.py"
    script.write_text(GATEWAY)
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    gw = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                          env=env, cwd=ROOT)  # fmt: skip
    parsers: set[int] = set()
    try:
        assert gw.stdout is not None and gw.stdout.readline().strip() == "m"
        parsers = _children(gw.pid)
        assert len(parsers) >= 2  # the pool's processes (and multiprocessing's resource tracker)
        gw.send_signal(signal.SIGKILL)
        gw.wait(10)
        deadline = time.monotonic() + 10
        while any(_running(p) for p in parsers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not [p for p in parsers if _running(p)]
    finally:
        if gw.poll() is None:
            gw.kill()
            gw.wait()
        for p in parsers:
            if _running(p):
                os.kill(p, signal.SIGKILL)

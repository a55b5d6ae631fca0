"""Tie an engine's life to a supervisor that is not its parent.

`flexpipe up` supervises a controller, which launches the engines. The engines must outlive a
controller that crashes (a restarted controller adopts them: docs/controller.md, "Crash
safety") yet die with `up`, even with `kill -9`. A parent-death signal cannot name a
grandparent, so the launcher runs

    python -m flexpipe.launch.guard --supervisor PID -- ENGINE ARGV...

The guard starts the engine (which gets SIGTERM if the guard dies: PR_SET_PDEATHSIG), then waits for
whichever comes first: the engine exits (the guard exits with its status), the supervisor exits
(watched through a pidfd: no polling, no pid reuse), or SIGTERM/SIGINT (both forwarded to the
engine). The guard and its engine share one process group, so stopping the group stops both.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import sys

from flexpipe.launch.process import die_with_parent

__all__ = ["guard_argv", "main"]


def guard_argv(supervisor_pid: int, argv: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "flexpipe.launch.guard",
        "--supervisor",
        str(supervisor_pid),
        "--",
        *argv,
    ]


async def _run(supervisor_pid: int, argv: list[str]) -> int:
    loop = asyncio.get_running_loop()
    gone = asyncio.Event()
    try:
        pidfd = os.pidfd_open(supervisor_pid)
    except ProcessLookupError:
        return 1  # the supervisor is already gone: start nothing
    loop.add_reader(pidfd, gone.set)
    proc = await asyncio.create_subprocess_exec(*argv, preexec_fn=die_with_parent)
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, _forward, proc, sig)
    done = asyncio.ensure_future(proc.wait())
    lost = asyncio.ensure_future(gone.wait())
    await asyncio.wait([done, lost], return_when=asyncio.FIRST_COMPLETED)
    if not done.done():  # the supervisor died: so does the engine
        _forward(proc, signal.SIGTERM)
        try:
            async with asyncio.timeout(10):
                await proc.wait()
        except TimeoutError:
            _forward(proc, signal.SIGKILL)
            await proc.wait()
    lost.cancel()
    loop.remove_reader(pidfd)
    os.close(pidfd)
    code = proc.returncode
    return 128 - code if code is not None and code < 0 else (code or 0)


def _forward(proc: asyncio.subprocess.Process, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m flexpipe.launch.guard")
    parser.add_argument("--supervisor", type=int, required=True)
    parser.add_argument("argv", nargs=argparse.REMAINDER)
    ns = parser.parse_args(args)
    argv = ns.argv[1:] if ns.argv[:1] == ["--"] else ns.argv
    if not argv:
        parser.error("nothing to run after --")
    return asyncio.run(_run(ns.supervisor, argv))


if __name__ == "__main__":
    sys.exit(main())

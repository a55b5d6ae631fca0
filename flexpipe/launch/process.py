"""Engine processes on this machine, as every launcher runs them: each in its own process
group (an engine forks workers; the group is stopped as a whole), its output in a log file
whose last lines explain a failure, on a port picked free just before it starts."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

__all__ = [
    "die_with_parent",
    "free_port",
    "group_alive",
    "log_tail",
    "pid_alive",
    "safe_name",
    "signal_group",
    "stop_group",
]


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a process group; one that is gone (or not ours) is left alone, and so is an
    unknown one (0 would be our own group)."""
    if pgid <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists on this host (one not ours to signal counts)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def group_alive(pgid: int) -> bool:
    """Whether any process of the group lives (one not ours to signal counts as alive)."""
    if pgid <= 0:
        return False
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_group(proc: subprocess.Popen[bytes], grace_s: float) -> int:
    """SIGTERM the group `proc` leads, wait up to `grace_s` for it, then SIGKILL what is left
    of the group (children it forked may outlive it); `proc`'s exit status."""
    signal_group(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(grace_s)
    signal_group(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(5.0)
    return proc.returncode if proc.returncode is not None else -9


def die_with_parent() -> None:
    """In the child before exec: on Linux, get SIGTERM when the launcher dies, so that even a
    `kill -9` of `flexpipe up` leaves no engine behind (PR_SET_PDEATHSIG)."""
    if sys.platform != "linux":
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def log_tail(path: Path, num_lines: int = 8) -> str:
    """The last lines of an engine's log ("" when there is none)."""
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-num_lines:])


def safe_name(name: str) -> str:
    """An instance name as a file name."""
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "engine"

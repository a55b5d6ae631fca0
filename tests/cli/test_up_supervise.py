"""`flexpipe up`'s supervision: the restart budget (pure, exact, a fake clock), and once, with
real processes, that a controller which keeps crashing after it served leaves the gateway
serving instead of stopping the service."""

from __future__ import annotations

import asyncio
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from flexpipe.cli.restart_budget import RestartBudget, RestartDecision, decide_restart
from flexpipe.cli.run_dir import (
    admin_token,
    controller_url,
    find_admin_token,
    remove_stale,
    run_dir,
)
from flexpipe.cli.supervise import supervise
from flexpipe.launch import free_port

BUDGET = RestartBudget(max_restarts=5, window_s=600, first_backoff_s=1, max_backoff_s=30,
                       slow_retry_s=60)  # fmt: skip


def test_backoff_doubles_within_the_window_then_the_controller_retries_slowly() -> None:
    restarts: list[float] = []
    delays = []
    now = 1000.0
    for _ in range(7):  # crashes at once after each start
        d = decide_restart(restarts, now, BUDGET, keep_trying=True)
        delays.append((d.delay_s, d.exhausted))
        now += d.delay_s
        restarts.append(now)
    assert delays == [(0, False), (1, False), (2, False), (4, False), (8, False),
                      (60, True), (60, True)]  # fmt: skip


def test_the_budget_is_per_window_not_per_life() -> None:
    # five crashes an hour apart: each one a first restart in its window, never a stop
    restarts: list[float] = []
    for i in range(20):
        now = 3600.0 * (i + 1)
        d = decide_restart(restarts, now, BUDGET, keep_trying=False)
        assert d == RestartDecision(True, 0.0, num_recent=0)
        restarts.append(now)
    # restarts older than the window do not count
    assert decide_restart([0, 1, 2, 3, 4], 605.0, BUDGET, keep_trying=False).num_recent == 0
    assert decide_restart([0, 1, 2, 3, 4], 603.5, BUDGET, keep_trying=False) == RestartDecision(
        True, 1.0, num_recent=1
    )


def test_a_spent_budget_stops_unless_told_to_keep_trying() -> None:
    full = [10.0, 20.0, 30.0, 40.0, 50.0]
    assert decide_restart(full, 60.0, BUDGET, keep_trying=False) == RestartDecision(
        False, exhausted=True, num_recent=5
    )
    assert decide_restart(full, 60.0, BUDGET, keep_trying=True) == RestartDecision(
        True, 60.0, exhausted=True, num_recent=5
    )
    # the backoff is capped
    capped = RestartBudget(max_restarts=20, max_backoff_s=30)
    assert decide_restart([float(i) for i in range(10)], 11.0, capped,
                          keep_trying=False).delay_s == 30.0  # fmt: skip


LISTENER = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("127.0.0.1", int(sys.argv[1]))); s.listen(16)
print("gateway listening", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""

# the first controller serves (prints the line `up` watches for), then crashes; each later one
# crashes at once
CRASHER = """
import os, sys
flag = sys.argv[1]
if not os.path.exists(flag):
    open(flag, "w").close()
    print("controller: admin API on http://127.0.0.1:1", flush=True)
sys.exit(1)
"""


def test_a_controller_that_keeps_crashing_leaves_the_gateway_serving(tmp_path: Path) -> None:
    port = free_port()
    gateway = [sys.executable, "-c", LISTENER, str(port)]
    controller = [sys.executable, "-c", CRASHER, str(tmp_path / "served")]
    budget = RestartBudget(max_restarts=3, window_s=600, first_backoff_s=0.05,
                           max_backoff_s=0.2, slow_retry_s=0.5)  # fmt: skip
    lines: list[str] = []

    async def scenario() -> tuple[int, bool, float]:
        stop = asyncio.Event()
        run = supervise(gateway, controller, "127.0.0.1", port, lines.append, 1.0,
                        budget=budget, stop=stop)  # fmt: skip
        task = asyncio.ensure_future(run)
        deadline = time.monotonic() + 60
        while not any("keep serving" in line for line in lines):
            assert time.monotonic() < deadline and not task.done(), lines
            await asyncio.sleep(0.05)
        t_exhausted = time.monotonic()
        await asyncio.sleep(1.5)  # a slow retry or more; up does not stop
        assert not task.done(), lines
        _, writer = await asyncio.open_connection("127.0.0.1", port)  # still serving
        writer.close()
        stop.set()
        return await task, True, time.monotonic() - t_exhausted

    rc, served_on, _ = asyncio.run(scenario())
    assert served_on and rc == 1  # the last controller's exit status
    loud = [line for line in lines if "keep serving" in line]
    assert len(loud) == 1, lines  # said once, not at every slow retry
    assert "exited 4 times within 600 s" in loud[0] and "retrying every 0.5 s" in loud[0]
    restarts = [line for line in lines if "restarting it" in line]
    assert restarts == [
        "error: the controller exited (1); restarting it",
        "error: the controller exited (1); restarting it in 0.05 s",
        "error: the controller exited (1); restarting it in 0.1 s",
    ]
    with socket.socket() as s:  # the gateway was stopped with `up`
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_a_controller_that_never_served_stops_up_with_its_status(tmp_path: Path) -> None:
    port = free_port()
    gateway = [sys.executable, "-c", LISTENER, str(port)]
    controller = [sys.executable, "-c", "import sys; print('error: no plan'); sys.exit(2)"]
    lines: list[str] = []
    rc = asyncio.run(supervise(gateway, controller, "127.0.0.1", port, lines.append, 1.0))
    assert rc == 2 and "error: no plan" in lines


# -- the run directory of `up` ------------------------------------------------------------------


def _dead_pid() -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return pid


def test_stale_run_dirs_are_removed_live_ones_kept(tmp_path: Path) -> None:
    stale = tmp_path / "flexpipe-up-8000-dead"
    stale.mkdir()
    (stale / "pid").write_text(str(_dead_pid()))
    (stale / "admin-token").write_text("secret")
    live = tmp_path / "flexpipe-up-8001-live"
    live.mkdir()
    (live / "pid").write_text(str(os.getpid()))
    legacy = tmp_path / "flexpipe-up-k2j4x9ab"  # an older `up`: no pid file, its two tokens
    legacy.mkdir()
    (legacy / "gateway-token").write_text("a")
    (legacy / "engine-token").write_text("b")
    other = tmp_path / "flexpipe-up-notes"  # not ours to judge: kept
    other.mkdir()
    (other / "notes.txt").write_text("keep")
    assert remove_stale(tmp_path) == [stale, legacy]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "flexpipe-up-8001-live", "flexpipe-up-notes"]  # fmt: skip


def test_the_run_dir_holds_the_token_for_its_controller(tmp_path: Path) -> None:
    url = "http://127.0.0.1:18100"
    with run_dir(18000, "http://127.0.0.1:18000", url, root=tmp_path) as rd:
        assert rd.path.name.startswith("flexpipe-up-18000-")
        assert oct(rd.path.stat().st_mode & 0o777) == "0o700"
        assert oct(rd.admin_token_file.stat().st_mode & 0o777) == "0o600"
        assert (rd.path / "pid").read_text() == str(os.getpid())
        token = rd.admin_token_file.read_text()
        assert len(token) >= 32
        assert find_admin_token(url + "/", tmp_path) == token
        assert find_admin_token("http://127.0.0.1:9999", tmp_path) is None
        assert admin_token(url, "given", None) == "given"  # a flag wins
        assert remove_stale(tmp_path) == []  # its owner (this process) lives
    assert list(tmp_path.iterdir()) == []


def test_commands_find_the_controller_of_the_running_up(tmp_path: Path) -> None:
    """`flexpipe status` / `cluster` without --controller: the running `up`'s controller,
    whatever ports it was given; none running: the default; two: an error naming both."""
    assert controller_url(None, tmp_path) == "http://127.0.0.1:8100"
    url = "http://127.0.0.1:18177"
    with run_dir(18077, "http://127.0.0.1:18077", url, root=tmp_path):
        assert controller_url(None, tmp_path) == url
        assert controller_url("http://10.0.0.9:8100", tmp_path) == "http://10.0.0.9:8100"
        with run_dir(18078, "http://127.0.0.1:18078", "http://127.0.0.1:18178", root=tmp_path):
            with pytest.raises(ValueError, match="2 `flexpipe up` are running") as err:
                controller_url(None, tmp_path)
            assert url in str(err.value) and "http://127.0.0.1:18178" in str(err.value)

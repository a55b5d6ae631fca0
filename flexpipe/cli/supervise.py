"""`flexpipe up`'s supervision of its two children, the gateway and the controller: start
them, relay their output, start one that died again within its budget
(cli/restart_budget.py), stop them in order."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.cli.controller import SERVING_LINE
from flexpipe.cli.restart_budget import RestartBudget, RestartDecision, decide_restart
from flexpipe.launch.process import die_with_parent

__all__ = ["DEFAULT_BUDGET", "UpError", "supervise"]


class UpError(ValueError):
    """`flexpipe up` cannot go on; one line for the user."""


async def _relay_lines(stream: asyncio.StreamReader, say: Callable[[str], None]) -> None:
    while line := await stream.readline():
        say(line.decode("utf-8", "replace").rstrip("\n"))


async def _start(
    argv: list[str], say: Callable[[str], None]
) -> tuple[asyncio.subprocess.Process, asyncio.Task[None]]:
    """The process and the task relaying its output."""
    proc = await asyncio.create_subprocess_exec(
        *argv,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
        preexec_fn=die_with_parent,
        start_new_session=True,  # Ctrl-C reaches `up` alone: it stops them in order
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    assert proc.stdout is not None
    return proc, asyncio.get_running_loop().create_task(_relay_lines(proc.stdout, say))


async def _stop(proc: asyncio.subprocess.Process, timeout_s: float) -> int:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)
        try:
            async with asyncio.timeout(timeout_s):
                await proc.wait()
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode if proc.returncode is not None else -1


async def _wait_listening(host: str, port: int, proc: asyncio.subprocess.Process) -> None:
    """Until the gateway accepts connections (it is not /health-y before an engine is)."""
    while proc.returncode is None:
        try:
            _, writer = await asyncio.open_connection(host, port)
        except OSError:
            await asyncio.sleep(0.05)
            continue
        writer.close()
        return
    raise UpError(f"the gateway exited ({proc.returncode}); see its error above")


DEFAULT_BUDGET = RestartBudget()


@dataclass
class _Child:
    """One supervised process: its argv, the running process, when it was restarted."""

    name: str
    argv: list[str]
    say: Callable[[str], None]
    proc: asyncio.subprocess.Process | None = None
    relay: asyncio.Task[None] | None = None
    restarts_s: list[float] = field(default_factory=list)
    restart_at_s: float | None = None  # a restart is due then
    exhausted: bool = False  # said so already

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.returncode is None

    async def start(self, now_s: float | None = None) -> None:
        if now_s is not None:
            self.restarts_s.append(now_s)
        self.restart_at_s = None
        self.proc, self.relay = await _start(self.argv, self.say)

    async def last_words(self, timeout_s: float = 0.5) -> None:
        """Its last lines relayed (what it said before it died decides what `up` does)."""
        if self.relay is not None:
            await asyncio.wait([self.relay], timeout=timeout_s)


def _gave_up(child: _Child, rc: int, decision: RestartDecision, budget: RestartBudget) -> str:
    return (
        f"error: the {child.name} exited ({rc}) {decision.num_recent + 1} times within "
        f"{budget.window_s:g} s; stopping"
    )


async def supervise(
    gateway_argv: list[str],
    controller_argv: list[str],
    host: str,
    port: int,
    say: Callable[[str], None],
    drain_timeout_s: float,
    budget: RestartBudget = DEFAULT_BUDGET,
    on_stop: Callable[[], None] | None = None,
    stop: asyncio.Event | None = None,
    clock: Callable[[], float] = time.monotonic,
) -> int:
    """Run the gateway, then the controller, until SIGINT/SIGTERM (or `stop`). A child that
    dies is started again (a controller adopts the engines its predecessor left, and gives a new
    gateway its pool back) within its own budget, with backoff (restart_budget.py). A
    controller that served and spent its budget is retried slowly while the gateway and the
    engines serve on; a gateway that spent its budget, or a controller that never served
    (exit status 2: it said why; or its budget spent) stops everything. Returns the
    controller's exit status."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)
    served = False

    def controller_says(line: str) -> None:
        nonlocal served
        served = served or line.startswith(SERVING_LINE)
        say(line)

    gateway = _Child("gateway", gateway_argv, say)
    controller = _Child("controller", controller_argv, controller_says)
    await gateway.start()
    try:
        assert gateway.proc is not None
        await _wait_listening(host, port, gateway.proc)
        say(
            f"flexpipe up: OpenAI API at http://{host}:{port}/v1, dashboard at "
            f"http://{host}:{port}/ui (starting engines)"
        )
        await controller.start()
        while True:
            waits: list[asyncio.Future[object]] = [asyncio.ensure_future(stop.wait())]
            waits += [
                asyncio.ensure_future(c.proc.wait())
                for c in (gateway, controller)
                if c.running and c.proc
            ]
            due = [c.restart_at_s for c in (gateway, controller) if c.restart_at_s is not None]
            timeout_s = max(0.0, min(due) - clock()) if due else None
            await asyncio.wait(waits, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
            for w in waits:
                w.cancel()
            if stop.is_set():
                if on_stop is not None:
                    on_stop()  # e.g. the demo's load: no new requests while draining
                assert controller.proc is not None
                return await _stop(controller.proc, drain_timeout_s + 30)
            now_s = clock()
            for child in (gateway, controller):
                proc = child.proc
                if proc is None or proc.returncode is None or child.restart_at_s is not None:
                    continue
                rc = proc.returncode
                await child.last_words()
                if child is controller and rc == 2 and not served:
                    return 2  # it could not start the plan, and said why
                keep_trying = child is controller and served
                decision = decide_restart(child.restarts_s, now_s, budget, keep_trying=keep_trying)
                if not decision.restart:
                    say(_gave_up(child, rc, decision, budget))
                    return rc if child is controller else 1
                if decision.exhausted and not child.exhausted:
                    say(
                        f"error: the controller exited {decision.num_recent + 1} times within "
                        f"{budget.window_s:g} s; the gateway and the engines keep serving, but "
                        f"nothing shifts gears until it is back (retrying every "
                        f"{decision.delay_s:g} s)"
                    )
                elif not decision.exhausted:
                    when = f" in {decision.delay_s:g} s" if decision.delay_s else ""
                    say(f"error: the {child.name} exited ({rc}); restarting it{when}")
                child.exhausted = decision.exhausted
                child.restart_at_s = now_s + decision.delay_s
            for child in (gateway, controller):
                if child.restart_at_s is not None and child.restart_at_s <= clock():
                    await child.start(clock())
                    if child is gateway:
                        assert gateway.proc is not None
                        await _wait_listening(host, port, gateway.proc)
    finally:
        if controller.proc is not None:
            await _stop(controller.proc, drain_timeout_s + 30)
        if gateway.proc is not None:
            await _stop(gateway.proc, drain_timeout_s + 5)
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
                loop.remove_signal_handler(sig)

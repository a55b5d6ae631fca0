"""Local-process launcher: each engine is a child process in its own process group.

`engine="sim"` runs `python -m flexpipe.engine.sim MODEL <vllm flags> <sim flags>`;
`engine="vllm"` runs `vllm serve WEIGHTS <the same vllm flags>` and `engine="sglang"`
`python -m sglang.launch_server --model-path WEIGHTS ...` (flexpipe/launch/command.py), with
CUDA_VISIBLE_DEVICES set to the spec's GPU indices. `vllm_command` replaces `vllm serve`
(tests point it at the sim engine, which accepts the same flags, so the vLLM path is
exercised without GPUs).

Stopping sends SIGTERM to the whole process group (vLLM forks workers), waits `stop_grace_s`,
then SIGKILLs the group. Ready means GET /health answers 200; the engine's output goes to a
log file whose last lines are quoted when it fails. After a controller restart, `adopt` takes
back the engines of the store whose process group still lives (`AdoptedEngine`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from flexpipe.launch.base import EngineHandle, EngineSpec, HandleBase, LaunchError
from flexpipe.launch.command import (
    SGLANG_COMMAND,
    SIM_COMMAND,
    VLLM_COMMAND,
    check_engine,
    engine_argv,
    engine_env,
)
from flexpipe.launch.health import wait_ready
from flexpipe.launch.process import (
    die_with_parent,
    free_port,
    group_alive,
    log_tail,
    safe_name,
    signal_group,
)

if TYPE_CHECKING:
    from flexpipe.store.instance_registry import InstanceRecord


class LocalEngine(HandleBase):
    """A running engine process (implements EngineHandle)."""

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        endpoint: str,
        log_path: Path,
        stop_grace_s: float,
    ) -> None:
        super().__init__(name, endpoint)
        self.proc = proc
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def log_tail(self, num_lines: int = 8) -> str:
        return log_tail(self.log_path, num_lines)

    def exit_message(self) -> str:
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        return f"engine {self.name} ({self.endpoint}) {how}" + self._log_lines()

    def _log_lines(self) -> str:
        tail = self.log_tail()
        return f"; last log lines ({self.log_path}):\n{tail}" if tail else ""

    async def exited_message(self) -> str:
        return "engine exited before it became ready: " + self.exit_message()

    async def log_lines(self) -> str:
        return self._log_lines()

    async def _stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it after the grace period."""
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.stop_grace_s):
                await self.proc.wait()
        # Children the engine forked may outlive it: kill what is left of the group.
        signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            async with asyncio.timeout(5.0):
                await self.proc.wait()


class AdoptedEngine(HandleBase):
    """An engine another controller started (implements EngineHandle): known by its
    endpoint and process group, stopped by signalling the group."""

    def __init__(self, record: InstanceRecord, stop_grace_s: float = 10.0) -> None:
        super().__init__(record.name, record.endpoint, record.cold_start_s or 0.0)
        self.pgid = record.pgid or record.pid or 0
        self.stop_grace_s = stop_grace_s

    @property
    def pid(self) -> int:
        return self.pgid

    @property
    def returncode(self) -> int | None:
        """None while any process of its group lives (the exit status is not ours to see)."""
        return None if group_alive(self.pgid) else -1

    async def _stop(self) -> None:
        signal_group(self.pgid, signal.SIGTERM)
        for _ in range(int(self.stop_grace_s / 0.05)):
            if not group_alive(self.pgid):
                return
            await asyncio.sleep(0.05)
        signal_group(self.pgid, signal.SIGKILL)


class LocalLauncher:
    """Implements Launcher with local child processes."""

    def __init__(
        self,
        engine: str = "sim",
        *,
        host: str = "127.0.0.1",
        time_scale: float = 1.0,
        sim_load_time_s: float | None = None,
        ready_timeout_s: float = 900.0,
        stop_grace_s: float = 10.0,
        log_dir: str | Path | None = None,
        sim_command: Sequence[str] = SIM_COMMAND,
        vllm_command: Sequence[str] = VLLM_COMMAND,
        env: dict[str, str] | None = None,
        supervisor_pid: int | None = None,
        sglang_command: Sequence[str] = SGLANG_COMMAND,
    ) -> None:
        """`supervisor_pid`: engines live as long as that process (through a guard,
        flexpipe/launch/guard.py) instead of as long as this one — a controller under
        `flexpipe up` may crash and be restarted while its engines serve on."""
        check_engine(engine)
        self.engine = engine
        self.host = host
        self.time_scale = time_scale
        self.sim_load_time_s = sim_load_time_s
        self.ready_timeout_s = ready_timeout_s
        self.stop_grace_s = stop_grace_s
        self.log_dir = Path(log_dir) if log_dir else Path(tempfile.gettempdir()) / "flexpipe-logs"
        self.sim_command = tuple(sim_command)
        # Called with (spec, pid, endpoint) the moment an engine's process exists, before it
        # is ready: the controller records it in the store then, so that a controller killed
        # during a cold start leaves no engine its successor does not know of.
        self.on_spawn: Callable[[EngineSpec, int, str], None] | None = None
        self.vllm_command = tuple(vllm_command)
        self.sglang_command = tuple(sglang_command)
        self.env = env or {}
        self.supervisor_pid = supervisor_pid

    async def adopt(self, records: Sequence[InstanceRecord]) -> Mapping[int, EngineHandle]:
        """After a controller restart: the engines of `records` whose process group lives
        (their /health is the caller's to ask). Nothing else of ours can be left: every
        engine is in the store from its spawn on (`on_spawn`)."""
        return {
            r.id: AdoptedEngine(r, self.stop_grace_s)
            for r in records
            if group_alive(r.pgid or r.pid or 0)
        }

    def command(self, spec: EngineSpec, port: int) -> tuple[list[str], dict[str, str]]:
        """The argv and environment for a spec (public so users can see what runs)."""
        env = dict(os.environ)
        env.update(self.env)
        env.update(engine_env(self.engine, spec))
        argv = engine_argv(
            self.engine,
            spec,
            self.host,
            port,
            sim_command=self.sim_command,
            vllm_command=self.vllm_command,
            sglang_command=self.sglang_command,
            cluster=spec.cluster_file,
            time_scale=self.time_scale,
            load_time_s=self.sim_load_time_s,
        )
        return argv, env

    async def start(self, spec: EngineSpec) -> LocalEngine:
        port = free_port(self.host)
        argv, env = self.command(spec, port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{safe_name(spec.name)}-{port}.log"
        endpoint = f"http://{self.host}:{port}"
        started = time.monotonic()
        preexec: Callable[[], None] | None = die_with_parent
        if self.supervisor_pid is not None:
            from flexpipe.launch.guard import guard_argv

            argv, preexec = guard_argv(self.supervisor_pid, argv), None
        with open(log_path, "wb") as log:
            log.write(("$ " + " ".join(argv) + "\n").encode())
            log.flush()
            try:
                proc = await asyncio.create_subprocess_exec(
                    *argv,
                    stdin=asyncio.subprocess.DEVNULL,
                    stdout=log,
                    stderr=asyncio.subprocess.STDOUT,
                    env=env,
                    start_new_session=True,  # own process group: stopped as a whole
                    preexec_fn=preexec,
                )
            except OSError as exc:
                raise LaunchError(
                    f"cannot start engine {spec.name}: {argv[0]}: {exc.strerror or exc}"
                ) from None
        handle = LocalEngine(spec.name, proc, endpoint, log_path, self.stop_grace_s)
        if self.on_spawn is not None:
            try:
                self.on_spawn(spec, proc.pid, endpoint)
            except BaseException:
                await handle.stop()
                raise
        await wait_ready(handle, self.ready_timeout_s)
        handle._cold_start_s = time.monotonic() - started
        return handle

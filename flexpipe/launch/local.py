"""Local-process launcher: each engine is a child process in its own process group.

`engine="sim"` runs `python -m flexpipe.engine.sim MODEL <vllm flags> <sim flags>`;
`engine="vllm"` runs `vllm serve MODEL <the same vllm flags>` with CUDA_VISIBLE_DEVICES set
to the spec's GPU indices. `vllm_command` replaces `vllm serve` (tests point it at the sim
engine, which accepts the same flags, so the vLLM path is exercised without GPUs).

Stopping sends SIGTERM to the whole process group (vLLM forks workers), waits `stop_grace_s`,
then SIGKILLs the group. Ready means GET /health answers 200; the engine's output goes to a
log file whose last lines are quoted when it fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.launch.base import EngineExited, EngineNotReady, EngineSpec, LaunchError

SIM_COMMAND: tuple[str, ...] = (sys.executable, "-m", "flexpipe.engine.sim")
VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
ENGINES = ("sim", "vllm")


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the engine binds it a moment later)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def vllm_flags(spec: EngineSpec, host: str, port: int) -> list[str]:
    """The `vllm serve` flags for a gear (the sim engine accepts the same)."""
    g = spec.gear
    flags = [
        spec.model,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(g.tp),
        "--pipeline-parallel-size",
        str(g.pp),
        "--max-num-seqs",
        str(g.max_num_seqs),
        "--max-num-batched-tokens",
        str(g.max_num_batched_tokens),
        "--block-size",
        str(g.block_size),
        "--kv-cache-dtype",
        g.kv_cache_dtype,
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--enable-prefix-caching" if g.enable_prefix_caching else "--no-enable-prefix-caching",
        # a request moved off a drained instance is sent with a negative priority: it takes
        # the next free slot ahead of the queue (every other request has priority 0: FCFS)
        "--scheduling-policy",
        "priority",
    ]
    if g.dtype in ("bf16", "fp16", "fp32"):
        flags += ["--dtype", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[g.dtype]]
    elif g.dtype == "fp8":
        flags += ["--quantization", "fp8"]
    elif g.dtype == "int8":
        flags += ["--quantization", "int8"]
    elif g.dtype == "int4":
        flags += ["--quantization", "awq"]
    if spec.served_model_name:
        flags += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len:
        flags += ["--max-model-len", str(spec.max_model_len)]
    return flags + list(spec.extra_args)


class LocalEngine:
    """A running engine process (implements EngineHandle)."""

    def __init__(
        self,
        name: str,
        proc: asyncio.subprocess.Process,
        endpoint: str,
        log_path: Path,
        stop_grace_s: float,
    ) -> None:
        self._name = name
        self.proc = proc
        self._endpoint = endpoint
        self.log_path = log_path
        self.stop_grace_s = stop_grace_s
        self._cold_start_s = 0.0
        self._stopped = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def cold_start_s(self) -> float:
        return self._cold_start_s

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode

    def log_tail(self, num_lines: int = 8) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def exit_message(self) -> str:
        code = self.proc.returncode
        how = f"was killed by signal {-code}" if code is not None and code < 0 else f"exited {code}"
        tail = self.log_tail()
        return f"engine {self.name} ({self.endpoint}) {how}" + (
            f"; last log lines ({self.log_path}):\n{tail}" if tail else ""
        )

    async def stop(self) -> None:
        """SIGTERM the process group, then SIGKILL it after the grace period."""
        if self._stopped:
            return
        self._stopped = True
        pgid = self.proc.pid  # start_new_session: the group id is the child's pid
        signal_group(pgid, signal.SIGTERM)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.proc.wait(), self.stop_grace_s)
        # Children the engine forked may outlive it: kill what is left of the group.
        signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            await asyncio.wait_for(self.proc.wait(), 5.0)


def signal_group(pgid: int, sig: signal.Signals) -> None:
    """Signal a process group; one that is gone (or not ours) is left alone, and so is an
    unknown one (0 would be our own group)."""
    if pgid <= 0:
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


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
    ) -> None:
        """`supervisor_pid`: engines live as long as that process (through a guard,
        flexpipe/launch/guard.py) instead of as long as this one — a controller under
        `flexpipe up` may crash and be restarted while its engines serve on."""
        if engine not in ENGINES:
            raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")
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
        self.env = env or {}
        self.supervisor_pid = supervisor_pid

    def command(self, spec: EngineSpec, port: int) -> tuple[list[str], dict[str, str]]:
        """The argv and environment for a spec (public so users can see what runs)."""
        env = dict(os.environ)
        env.update(self.env)
        env.update(dict(spec.env))
        flags = vllm_flags(spec, self.host, port)
        if self.engine == "vllm":
            if spec.gpu_indices:
                env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
            return [*self.vllm_command, *flags], env
        sim = ["--time-scale", repr(self.time_scale)]
        if spec.cluster_file and spec.gpu_ids:
            sim += ["--cluster", spec.cluster_file, "--gpu-ids", _stage_ids(spec)]
        else:
            sim += ["--gpu-type", spec.gpu_type, "--link", spec.link]
            if spec.pp_link:
                sim += ["--pp-link", spec.pp_link]
        if self.sim_load_time_s is not None:
            sim += ["--load-time-s", repr(self.sim_load_time_s)]
        env.setdefault("PYTHONUNBUFFERED", "1")
        return [*self.sim_command, *flags, *sim], env

    async def start(self, spec: EngineSpec) -> LocalEngine:
        port = free_port(self.host)
        argv, env = self.command(spec, port)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.log_dir / f"{_safe(spec.name)}-{port}.log"
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
        try:
            await wait_ready(handle, self.ready_timeout_s)
        except BaseException:
            await handle.stop()
            raise
        handle._cold_start_s = time.monotonic() - started
        return handle


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


async def wait_ready(handle: LocalEngine, timeout_s: float, poll_s: float = 0.1) -> None:
    """Poll GET /health until 200; raise if the process exits or time runs out."""
    pool = ClientPool()
    deadline = time.monotonic() + timeout_s
    timeouts = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)
    try:
        while True:
            if handle.returncode is not None:
                raise EngineExited(
                    "engine exited before it became ready: " + handle.exit_message(),
                    handle.returncode,
                )
            with contextlib.suppress(UpstreamError, OSError):
                resp = await pool.request(handle.endpoint, "GET", "/health", timeouts=timeouts)
                await resp.read()
                resp.release()
                if resp.status == 200:
                    return
            if time.monotonic() >= deadline:
                tail = handle.log_tail()
                raise EngineNotReady(
                    f"engine {handle.name} did not become ready (GET /health 200) within "
                    f"{timeout_s:g} s; stopped it"
                    + (f"; last log lines ({handle.log_path}):\n{tail}" if tail else "")
                )
            await asyncio.sleep(poll_s)
    finally:
        await pool.close()


def _stage_ids(spec: EngineSpec) -> str:
    tp = spec.gear.tp
    ids = list(spec.gpu_ids)
    return ";".join(",".join(ids[i : i + tp]) for i in range(0, len(ids), tp))


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name) or "engine"

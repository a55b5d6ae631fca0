"""`flexpipe gateway --workers N`: every core of the host on one port.

The supervisor (this process) reserves the port, runs the state service the workers share
(state_service.py) and starts N worker processes. Each worker is a whole `Gateway` that binds
its own listening socket to the port with SO_REUSEPORT, so the kernel spreads new connections
between them; it joins the shared state and replays its control log before it listens, so a
worker restarted later sees the pool, holds and refusals the others see. A worker that dies
is restarted (at most once per `RESTART_BACKOFF_S`); its open connections die with it (its
streams end, as on any lost connection), the other workers' do not. SIGTERM or SIGINT drain
every worker (each its own grace period, gateway/app.py `shutdown`), then the supervisor
exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import multiprocessing
import os
import signal
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.process import BaseProcess
from typing import Any

from flexpipe.gateway.config import GatewayConfig
from flexpipe.gateway.shared_state import SharedState
from flexpipe.gateway.state_service import EmbeddedState, StateService

__all__ = [
    "RESTART_BACKOFF_S",
    "Supervisor",
    "default_num_workers",
    "reuse_port_socket",
    "stop_on_signals",
]

log = logging.getLogger("flexpipe.gateway")

RESTART_BACKOFF_S = 1.0  # a worker that keeps dying is restarted at most this often
_CTX = multiprocessing.get_context("spawn")  # a clean interpreter: no loop, no fds inherited


def default_num_workers() -> int:
    """The host's cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:
        return max(1, os.cpu_count() or 1)


def reuse_port_socket(host: str, port: int, listen: bool) -> socket.socket:
    """A TCP socket bound to host:port with SO_REUSEPORT (listening, for a worker; bound only,
    for the supervisor's reservation of the port, which takes no connection)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    if listen:
        sock.listen(2048)
    sock.setblocking(False)
    return sock


def make_shared(
    cfg: GatewayConfig, state_path: str | None, index: int, on_lost: Callable[[], None]
) -> SharedState | None:
    """The shared state of one gateway process: Redis when configured (replicas), else the
    supervisor's service (workers of one host, `state_path`), else none (alone)."""
    if cfg.shared_state.url is not None:
        from flexpipe.gateway.redis_state import RedisState

        member = f"{socket.gethostname()}:{cfg.port}:{os.getpid()}"
        return RedisState(cfg.shared_state, cfg.tenants, member)
    if state_path is not None:
        return EmbeddedState(state_path, str(index), on_lost=on_lost)
    return None


def _accepts(host: str, port: int) -> bool:
    """Something accepts connections on host:port now."""
    try:
        with socket.create_connection((host, port), 0.5):
            return True
    except OSError:
        return False


def worker_main(
    cfg: GatewayConfig,
    index: int,
    num_workers: int,
    state_path: str,
    log_level: int,
    ready: Any,
) -> None:
    """A worker process: a gateway on the shared port until SIGTERM / SIGINT, then drained."""
    from flexpipe.gateway.app import Gateway
    from flexpipe.http.server import install_uvloop

    logging.basicConfig(
        level=log_level,
        format=f"%(levelname)s %(name)s[worker {index}]: %(message)s",
    )
    install_uvloop()

    async def run() -> None:
        stop = asyncio.Event()
        shared = make_shared(cfg, state_path, index, stop.set)
        gw = Gateway(cfg, shared=shared, worker=(index, num_workers))
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await gw.start(sock=reuse_port_socket(cfg.host, cfg.port, listen=True))
        ready.set()
        await stop.wait()
        await gw.shutdown(cfg.shutdown_grace_s)

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


@dataclass
class _Worker:
    index: int
    proc: BaseProcess | None = None
    started_s: float = 0.0
    num_restarts: int = 0
    exited: asyncio.Event = field(default_factory=asyncio.Event)
    ready: Any = None  # a multiprocessing Event the worker sets once it listens


class Supervisor:
    """Runs `num_workers` gateway workers on `cfg.host`:`cfg.port` (0: a free port, fixed
    for the workers' life: `port`)."""

    def __init__(self, cfg: GatewayConfig, num_workers: int) -> None:
        self.cfg = cfg
        self.num_workers = num_workers
        self._dir = tempfile.mkdtemp(prefix="flexpipe-gw-")
        self.state_path = os.path.join(self._dir, "state.sock")
        self.service = StateService(self.state_path, cfg.tenants)
        self._reserved: socket.socket | None = None
        self.workers = [_Worker(i) for i in range(num_workers)]
        self.stopping = False
        self.port = cfg.port

    async def start(self) -> None:
        """Reserve the port, start the state service and the workers; returns once every
        worker listens."""
        if self.cfg.port and _accepts(self.cfg.host, self.cfg.port):
            # SO_REUSEPORT would let us join another gateway's group and take half its
            # connections: a port something already serves on is in use, as without it
            raise OSError(errno.EADDRINUSE, os.strerror(errno.EADDRINUSE))
        self._reserved = reuse_port_socket(self.cfg.host, self.cfg.port, listen=False)
        self.port = self._reserved.getsockname()[1]
        self.cfg.port = self.port
        await self.service.start()
        for w in self.workers:
            self._spawn(w)
        await self.wait_listening(30.0)

    async def wait_listening(self, timeout_s: float) -> None:
        """Until every worker listens."""
        deadline = time.monotonic() + timeout_s
        while not all(w.ready is not None and w.ready.is_set() for w in self.workers):
            if time.monotonic() > deadline:
                raise TimeoutError("the gateway's workers did not start")
            if all(w.proc is not None and not w.proc.is_alive() for w in self.workers):
                raise RuntimeError("every gateway worker exited at start; see the errors above")
            await asyncio.sleep(0.05)

    def _spawn(self, w: _Worker) -> None:
        w.ready = _CTX.Event()
        proc = _CTX.Process(
            target=worker_main,
            args=(
                self.cfg,
                w.index,
                self.num_workers,
                self.state_path,
                logging.getLogger().getEffectiveLevel(),
                w.ready,
            ),
            name=f"flexpipe-gateway-{w.index}",
        )
        proc.start()
        w.proc, w.started_s = proc, time.monotonic()
        w.exited.clear()
        loop = asyncio.get_running_loop()
        loop.add_reader(proc.sentinel, self._exited, w, proc)

    def _exited(self, w: _Worker, proc: BaseProcess) -> None:
        loop = asyncio.get_running_loop()
        loop.remove_reader(proc.sentinel)
        proc.join(1.0)  # (its sentinel closes as it exits: reaped within moments)
        w.exited.set()
        if self.stopping or w.proc is not proc:
            return
        log.warning(
            "gateway worker %d (pid %s) exited with %s; restarting it",
            w.index,
            proc.pid,
            proc.exitcode,
        )
        w.num_restarts += 1
        wait_s = max(0.0, RESTART_BACKOFF_S - (time.monotonic() - w.started_s))
        loop.call_later(wait_s, self._restart, w)

    def _restart(self, w: _Worker) -> None:
        if not self.stopping:
            self._spawn(w)

    def pids(self) -> list[int | None]:
        return [w.proc.pid if w.proc is not None else None for w in self.workers]

    async def stop(self) -> None:
        """Drain every worker (SIGTERM: each finishes its requests within its grace period),
        then stop the state service."""
        self.stopping = True
        for w in self.workers:
            if w.proc is not None and w.proc.is_alive():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(w.proc.pid or 0, signal.SIGTERM)
        bound_s = self.cfg.shutdown_grace_s + 5.0
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(bound_s):
                for w in self.workers:
                    if w.proc is not None and w.proc.is_alive():
                        await w.exited.wait()
        for w in self.workers:
            if w.proc is not None and w.proc.is_alive():
                w.proc.kill()
                w.proc.join(2.0)
        await self.service.close()
        if self._reserved is not None:
            self._reserved.close()
        with contextlib.suppress(OSError):
            os.rmdir(self._dir)


def stop_on_signals() -> asyncio.Event:
    """An event set by SIGTERM or SIGINT (installed before the workers start, so that a
    signal during their start drains them rather than killing the supervisor alone)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(sig, stop.set)
    return stop

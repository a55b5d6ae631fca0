"""The Ray actor that runs one engine on its node (the Ray launcher starts it in bundle 0 of
the instance's placement group; see launch/ray_launcher.py).

It picks a free port on its node, writes the placement's topology where the sim engine reads
it, and starts the engine under the guard (launch/guard.py) with the actor as supervisor: the
engine dies with the actor, whichever way the actor goes (stopped, killed with its placement
group, its node lost). Plain Python: Ray is only needed to find the node's address.

The argv it gets may hold placeholders, filled in on the node: `{python}` (this node's
interpreter), `{host}`, `{port}`, `{topology}` (a file with the topology YAML).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from flexpipe.launch.guard import guard_argv
from flexpipe.launch.process import free_port, log_tail, safe_name, stop_group

__all__ = ["EngineProcess"]


def node_address() -> str:
    """This node's address as Ray knows it (what other nodes reach it at)."""
    try:
        ray = importlib.import_module("ray")
        return str(ray.util.get_node_ip_address())
    except Exception:  # outside Ray (tests of the class itself)
        return "127.0.0.1"


class EngineProcess:
    """One engine process on this node, started at construction."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        env: Mapping[str, str],
        host: str | None,
        topology: str | None,
    ) -> None:
        self.name = name
        self.host = host or node_address()
        self.port = free_port(self.host)
        self.dir = Path(tempfile.mkdtemp(prefix=f"flexpipe-{safe_name(name)}-"))
        self.log_path = self.dir / "engine.log"
        topology_path = self.dir / "topology.yaml"
        if topology is not None:
            topology_path.write_text(topology, encoding="utf-8")
        fill = {
            "{python}": sys.executable,
            "{host}": self.host,
            "{port}": str(self.port),
            "{topology}": str(topology_path),
        }
        self.argv = [fill.get(a, a) for a in argv]
        full_env = {**os.environ, **env, "PYTHONUNBUFFERED": "1"}
        with open(self.log_path, "wb") as log:
            log.write(("$ " + " ".join(self.argv) + "\n").encode())
            log.flush()
            self.proc = subprocess.Popen(
                guard_argv(os.getpid(), self.argv),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                start_new_session=True,  # own group: the guard and the engine stop as one
            )
        self.started = time.monotonic()

    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def poll(self) -> int | None:
        return self.proc.poll()

    def wait(self, timeout_s: float | None = None) -> int | None:
        """Block until the engine exits (its exit status) or `timeout_s` passes (None). The
        launcher asks again and again rather than once for ever: a call its controller left
        when it crashed would hold one of the actor's threads until the engine exits, and
        each restart (which asks anew) would take one more."""
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, num_lines: int = 8) -> str:
        return log_tail(self.log_path, num_lines)

    def stop(self, grace_s: float) -> int:
        """SIGTERM the engine's group, SIGKILL what is left after `grace_s`; its exit status."""
        return stop_group(self.proc, grace_s)

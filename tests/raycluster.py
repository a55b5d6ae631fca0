"""A real Ray cluster on this machine, for tests: a head and worker nodes, each its own
`ray start --block` in its own process group, each declaring its own logical GPUs and
accelerator type and named by the `flexpipe/node` label.

Everything binds 127.0.0.1. Ray turns `--node-ip-address 127.0.0.1` into the machine's
outward address unless its cluster mode is off, and with it off refuses worker nodes; so nodes
start through Ray's own CLI with that one rewrite disabled, and drivers on this machine
(this test process, a controller) run with `RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`, which makes
them reach the cluster on 127.0.0.1 as well. A real multi-machine cluster needs none of this.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from flexpipe.launch.process import free_port, stop_group

ROOT = Path(__file__).resolve().parent.parent

# `ray start` with the localhost rewrite off (see the module docstring).
_NODE_MAIN = (
    "import sys; from ray._private import services; "
    "services.resolve_ip_for_localhost = lambda host: host; "
    "from ray.scripts.scripts import main; sys.argv[0] = 'ray'; sys.exit(main())"
)
HEAD_GRACE_S = 1.0
DRIVER_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}


@dataclass
class RayNodeProcess:
    name: str
    proc: subprocess.Popen[bytes]
    log_path: Path

    def stop(self, grace_s: float = 10.0) -> None:
        """Stop the node and every process it started (its process group)."""
        stop_group(self.proc, grace_s)


class LocalRayCluster:
    """`start_node(...)` the head first, then workers; `stop()` stops them all."""

    def __init__(self) -> None:
        # Short: Ray's unix sockets live under it (a path of at most 107 bytes).
        self.temp_dir = Path(tempfile.mkdtemp(prefix="fpray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: dict[str, RayNodeProcess] = {}

    def start_node(self, name: str, num_gpus: int, accelerator: str, num_cpus: int = 1) -> None:
        """Start a node and wait until it runs (the first one is the head)."""
        self._wait_started(self._spawn(name, num_gpus, accelerator, num_cpus))

    def _spawn(self, name: str, num_gpus: int, accelerator: str, num_cpus: int) -> RayNodeProcess:
        head = not self.nodes
        argv = [
            sys.executable, "-c", _NODE_MAIN, "start", "--block",
            "--node-ip-address", "127.0.0.1",
            "--num-cpus", str(num_cpus), "--num-gpus", str(num_gpus),
            "--resources", json.dumps({f"accelerator_type:{accelerator}": num_gpus}),
            "--labels", f"flexpipe/node={name}",
            "--object-store-memory", str(80 * 10**6),
            "--temp-dir", str(self.temp_dir), "--disable-usage-stats",
        ]  # fmt: skip
        if head:
            argv += ["--head", "--port", str(self.port), "--include-dashboard", "false"]
        else:
            argv += ["--address", self.address]
        env = {
            **os.environ,
            "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "1",
            "RAY_USAGE_STATS_ENABLED": "0",
            # a lost node is noticed in about 2 s instead of Ray's default 30 s
            "RAY_health_check_period_ms": "500",
            "RAY_health_check_timeout_ms": "1000",
            "RAY_health_check_failure_threshold": "3",
            "PYTHONPATH": str(ROOT),
        }
        log_path = self.temp_dir / f"{name}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        self.nodes[name] = RayNodeProcess(name, proc, log_path)
        return self.nodes[name]

    def _wait_started(self, node: RayNodeProcess, timeout_s: float = 120.0) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            text = node.log_path.read_text(errors="replace")
            if "Ray runtime started" in text:
                return
            if node.proc.poll() is not None:
                raise RuntimeError(f"ray node {node.name} exited:\n{text[-2000:]}")
            time.sleep(0.2)
        raise RuntimeError(f"ray node {node.name} did not start in {timeout_s:g} s")

    def stop_node(self, name: str, grace_s: float = 10.0) -> None:
        self.nodes.pop(name).stop(grace_s)

    def stop(self) -> None:
        names = list(self.nodes)
        for name in reversed(names[1:]):  # workers first, the head last
            self.stop_node(name)
        if names:
            # The head's `ray start --block` answers SIGTERM only after about 30 s (measured),
            # so its group was always SIGKILLed at the end of the grace: do that sooner.
            self.stop_node(names[0], grace_s=HEAD_GRACE_S)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

"""Start the gateways compared in bench/gateway_bench.py: flexpipe's own and the pip-installed
Rust peers (`sglang-router`, `vllm-router`) from their own virtual environments under bench/.

    python -m venv bench/.venv-sglang && bench/.venv-sglang/bin/pip install sglang-router
    python -m venv bench/.venv-vllm-router && bench/.venv-vllm-router/bin/pip install vllm-router
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

BENCH = Path(__file__).resolve().parent
ROOT = BENCH.parent
SGLANG_PY = BENCH / ".venv-sglang" / "bin" / "python"
VLLM_ROUTER = BENCH / ".venv-vllm-router" / "bin" / "vllm-router"


def available() -> dict[str, bool]:
    return {"sglang-router": SGLANG_PY.exists(), "vllm-router": VLLM_ROUTER.exists()}


def gateway_command(
    kind: str,
    backends: list[str],
    port: int,
    policy: str,
    config: Path | None = None,
    workers: int | None = None,
) -> list[str]:
    """`kind`: flexpipe | sglang-router | vllm-router; `policy` in that gateway's names.
    flexpipe only: `config` (a gateway.yaml with `routing:` params) instead of `--policy`,
    and `workers` (`--workers`; None: the flag is not passed, as to a checkout before it)."""
    if kind == "flexpipe":
        cmd = [sys.executable, "-m", "flexpipe", "gateway", "--port", str(port)]
        if workers is not None:
            cmd += ["--workers", str(workers)]
        for b in backends:
            cmd += ["--backend", b]
        if config is not None:
            return [*cmd, "--config", str(config)]
        return [*cmd, "--policy", policy]
    # Both Rust routers export Prometheus metrics on port 29000 by default: give each its own
    # (port + 1) so that they can run side by side.
    if kind == "sglang-router":
        return [str(SGLANG_PY), "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
                "--port", str(port), "--prometheus-port", str(port + 1), "--policy", policy,
                "--worker-urls", *backends]  # fmt: skip
    if kind == "vllm-router":
        return [str(VLLM_ROUTER), "--host", "127.0.0.1", "--port", str(port),
                "--prometheus-port", str(port + 1), "--policy", policy,
                "--worker-urls", *backends]  # fmt: skip
    raise ValueError(kind)


def start(cmd: list[str], tree: Path | None = None) -> subprocess.Popen[bytes]:
    """Start a gateway; `tree`: run flexpipe from that checkout instead (a baseline)."""
    logs = Path(tempfile.gettempdir()) / "flexpipe-bench-logs"
    logs.mkdir(exist_ok=True)
    log = open(logs / f"{Path(cmd[0]).name}-{os.getpid()}-{len(cmd)}.log", "wb")  # noqa: SIM115
    env = None
    if tree is not None:
        env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=tree or ROOT, env=env)

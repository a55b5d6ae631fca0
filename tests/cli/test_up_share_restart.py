"""`flexpipe up --share-gpus`, then kill -9 of its controller: the controller `up` starts again
adopts both engines sharing the one GPU as they run (no launch, none stopped), each with the
memory fraction its engine reports, the GPU counted once; `flexpipe status` lists both on it
(docs/gpu-sharing.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
from test_controller import Output, _is_controller
from test_launcher import marker, processes_with  # noqa: F401  (fixture)
from test_up import engines_with
from test_up_share import MODELS, ONE_GPU

from flexpipe.control.api.ui_api import TOPOLOGY_PATH
from flexpipe.hardware import gpu_spec
from flexpipe.launch import free_port


def _topology(port: int, token: str) -> dict[str, object]:
    req = urllib.request.Request(
        f"http://127.0.0.1:{port}{TOPOLOGY_PATH}", headers={"Authorization": f"Bearer {token}"}
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        doc: dict[str, object] = json.load(resp)
    return doc


def _g0(topo: dict[str, object]) -> dict[str, object]:
    (node,) = topo["nodes"]  # type: ignore[misc]
    (g0,) = node["gpus"]
    return g0  # type: ignore[no-any-return]


def test_a_restarted_controller_adopts_both_engines_of_a_shared_gpu(
    marker: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    (tmp_path / "one.yaml").write_text(ONE_GPU)
    (tmp_path / "models.yaml").write_text(MODELS.format(marker=marker))
    port, controller_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--share-gpus", "--port", str(port),
        "--controller-port", str(controller_port), "--time-scale", "0.02",
        "--cluster", str(tmp_path / "one.yaml"), "--models", str(tmp_path / "models.yaml"),
        "--store", f"sqlite:///{tmp_path / 'fp.db'}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    out = Output(proc)
    try:
        out.wait_for("serving", 120)
        engines = sorted(engines_with(marker))
        assert len(engines) == 2
        token_file = out.text.split("admin token in ", 1)[1].split(" ", 1)[0]
        token = Path(token_file).read_text().strip()
        memory_bytes = gpu_spec("A100-80G-SXM").memory_bytes
        assert _g0(_topology(controller_port, token))["flexpipe_bytes"] == pytest.approx(
            0.56 * memory_bytes
        )
        (controller,) = [p for p in processes_with(str(tmp_path)) if _is_controller(p)]
        os.kill(controller, signal.SIGKILL)
        n = out.wait_for("adopted 2 running instance(s)", 90)
        out.wait_for("instance(s) serving", 60, n)
        assert sorted(engines_with(marker)) == engines  # the same two: none launched, none left
        g0 = _g0(_topology(controller_port, token))
        instances = g0["instances"]
        assert isinstance(instances, list) and len(instances) == 2
        # each with its own fraction: their memory together, the GPU counted once
        assert g0["flexpipe_bytes"] == pytest.approx(0.56 * memory_bytes)
        # `flexpipe status`: both on g0, a row each
        shown = subprocess.run(
            [sys.executable, "-m", "flexpipe", "status", "--json", "--controller",
             f"http://127.0.0.1:{controller_port}", "--token-file", token_file],
            capture_output=True, text=True, env=env, timeout=60, check=True,
        )  # fmt: skip
        (row,) = json.loads(shown.stdout)["gpus"]
        names = sorted([row["instance"], *(name for name, _, _ in row["shared_with"])])
        assert names == [f"{marker}-chat-0", f"{marker}-sum-0"]
        proc.send_signal(signal.SIGINT)
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.text[-3000:]
    assert processes_with(marker) == []

"""`flexpipe up --share-gpus` as a user runs it: two small models on a one-GPU cluster, each
engine a real sim-engine process on that GPU with its own --gpu-memory-utilization, both
answering the official `openai` client; everything stopped after (docs/gpu-sharing.md)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import openai
import pytest
from test_launcher import marker, processes_with  # noqa: F401  (fixture)
from test_up import engines_with, wait_for_line

from flexpipe.control.api.ui_api import TOPOLOGY_PATH
from flexpipe.hardware import gpu_spec
from flexpipe.launch import free_port

ONE_GPU = "name: one\nnodes:\n  - name: n0\n    gpus:\n      - {id: g0, type: A100-80G-SXM}\n"
MODELS = """
models:
  - name: {marker}-chat
    model: llama-3.1-8b
    demand: {{request_rate_per_s: 0.3, input_tokens: 1024, output_tokens: 200}}
    slo: {{ttft_p99_ms: 2500, tpot_p99_ms: 80}}
  - name: {marker}-sum
    model: qwen2.5-7b
    demand: {{request_rate_per_s: 0.3, input_tokens: 1024, output_tokens: 200}}
    slo: {{ttft_p99_ms: 2500, tpot_p99_ms: 80}}
"""


def _flag(pid: int, name: str) -> str:
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index(name) + 1]


def test_two_models_share_the_one_gpu(marker: str, tmp_path: Path) -> None:  # noqa: F811
    cluster = tmp_path / "one.yaml"
    cluster.write_text(ONE_GPU)
    models = tmp_path / "models.yaml"
    models.write_text(MODELS.format(marker=marker))
    port, controller_port = free_port(), free_port()
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--share-gpus", "--port", str(port),
        "--controller-port", str(controller_port),
        "--time-scale", "0.02", "--cluster", str(cluster), "--models", str(models),
        "--store", f"sqlite:///{tmp_path / 'fp.db'}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        text = "".join(wait_for_line(proc, "serving", 120))
        assert text.count(" ready at ") == 2, text
        engines = engines_with(marker)
        assert len(engines) == 2
        # both on g0, each with its own share of its memory (the planner's fractions)
        assert sorted(_flag(p, "--gpu-memory-utilization") for p in engines) == ["0.26", "0.3"]
        assert {_flag(p, "--gpu-ids") for p in engines} == {"g0"}
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        names = sorted(m.id for m in client.models.list().data)
        assert names == [f"{marker}-chat", f"{marker}-sum"]
        for name in names:
            out = client.completions.create(model=name, prompt="hello there", max_tokens=5)
            assert out.usage is not None and out.usage.completion_tokens == 5
        # the dashboard's GPU map: g0 with both instances, their memory together
        token_file = text.split("admin token in ", 1)[1].split(" ", 1)[0]
        token = Path(token_file).read_text().strip()
        req = urllib.request.Request(
            f"http://127.0.0.1:{controller_port}{TOPOLOGY_PATH}",
            headers={"Authorization": f"Bearer {token}"},
        )
        with urllib.request.urlopen(req, timeout=10) as resp:
            topo = json.load(resp)
        (g0,) = topo["nodes"][0]["gpus"]
        assert len(g0["instances"]) == 2
        assert g0["flexpipe_bytes"] == pytest.approx(0.56 * gpu_spec("A100-80G-SXM").memory_bytes)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert "stopped 2 engine(s)" in rest
    assert processes_with(marker) == []

"""`flexpipe up` as a user runs it: a real process that plans the fragmented 4-GPU example,
launches sim engines, serves the OpenAI API through the gateway, and on SIGINT / SIGTERM
drains and stops everything it started."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
import pytest
from test_launcher import marker, processes_with  # noqa: F401  (fixture)
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.launch import free_port
from flexpipe.lifecycle import State
from flexpipe.store import Store
from flexpipe.store.instance_registry import InstanceRegistry

MODELS = """
models:
  - name: {name}
    model: llama-2-7b
    demand: {{request_rate_per_s: 8, input_tokens: 2048, output_tokens: 256}}
    slo: {{ttft_p99_ms: 2000, tpot_p99_ms: 60}}  # calibrated A100: 50.8 ms at batch 64
    dtypes: [bf16, fp8]
"""


def engines_with(needle: str) -> list[int]:
    """The engines among them (under `up`, each engine runs under a guard process that ties
    it to `up`: flexpipe/launch/guard.py)."""
    return [p for p in processes_with(needle) if b"flexpipe.launch.guard" not in _cmdline(p)]


def _cmdline(pid: int) -> bytes:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


def write_models(tmp_path: Path, name: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(MODELS.format(name=name))
    return path


def wait_for_line(proc: subprocess.Popen[str], needle: str, timeout_s: float) -> list[str]:
    lines: list[str] = []
    deadline = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        lines.append(line)
        if needle in line:
            return lines
    raise AssertionError(f"no {needle!r} in output:\n{''.join(lines)}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_up_serves_the_plan_and_stops_everything(
    marker: str,  # noqa: F811
    tmp_path: Path,
    sig: signal.Signals,
) -> None:
    port = free_port()
    store_url = f"sqlite:///{tmp_path / 'fp.db'}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port), "--time-scale", "0.02",
        "--controller-port", str(free_port()),
        "--models", str(write_models(tmp_path, marker)), "--store", store_url,
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        lines = wait_for_line(proc, "serving", 90)
        text = "".join(lines)
        # the seed's plan: TP2 over the NVLinked pair, single-GPU instances elsewhere
        assert "gpu2+gpu1" in text or "gpu1+gpu2" in text
        assert f"http://127.0.0.1:{port}/v1" in text
        assert text.count(" ready at ") == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x")
        assert [m.id for m in client.models.list().data] == [marker]
        for _ in range(4):
            out = client.completions.create(model=marker, prompt="hello there", max_tokens=5)
            assert out.usage is not None and out.usage.completion_tokens == 5
        chat = client.chat.completions.create(
            model=marker, messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
        assert chat.choices[0].finish_reason == "length"
        assert len(engines_with(marker)) == 3  # one engine per planned instance
        proc.send_signal(sig)
        rest, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, rest
    assert "draining" in rest and "stopped 3 engine(s)" in rest
    assert processes_with(marker) == []
    with Store(store_url) as store:
        rows = InstanceRegistry(store).instances()
    assert len(rows) == 3 and {r.state for r in rows} == {State.GONE}


def test_up_dry_run_prints_the_plan(tmp_path: Path) -> None:
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        app, ["up", "--dry-run", "--store", f"sqlite:///{tmp_path / 'fp.db'}"]
    )
    assert res.exit_code == 0, res.output
    assert "fragmented-4gpu" in res.output and "tp2-pp1-bf16" in res.output


def test_up_errors_are_one_line(tmp_path: Path) -> None:
    runner = CliRunner(env={"COLUMNS": "200"})
    store = ["--store", f"sqlite:///{tmp_path / 'fp.db'}"]
    res = runner.invoke(app, ["up", "--cluster", str(tmp_path / "nope.yaml"), *store])
    assert res.exit_code == 2 and "cannot read the file" in res.output
    res = runner.invoke(app, ["up", "--engine", "tgi", *store])
    assert res.exit_code == 2 and "unknown engine 'tgi'" in res.output
    # The example's GPUs sit in three nodes: vLLM through the local launcher runs on this
    # machine only; say so instead of starting engines on the wrong devices.
    res = runner.invoke(app, ["up", "--engine", "vllm", *store])
    assert res.exit_code == 2 and "nodes node0, node1, node2" in res.output
    assert "Traceback" not in res.output


def test_up_with_an_engine_that_cannot_start(marker: str, tmp_path: Path) -> None:  # noqa: F811
    one_node = tmp_path / "one-node.yaml"
    one_node.write_text(
        "name: one\nnodes:\n  - name: n0\n    gpus:\n      - {id: g0, type: A100-80G-SXM}\n"
    )
    res = CliRunner(env={"COLUMNS": "200"}).invoke(
        app,
        [
            "up", "--engine", "vllm", "--vllm-command", f"/nonexistent/vllm-{marker} serve",
            "--cluster", str(one_node), "--port", str(free_port()),
            "--models", str(write_models(tmp_path, marker)),
            "--store", f"sqlite:///{tmp_path / 'fp.db'}",
        ],
    )  # fmt: skip
    assert res.exit_code == 2, res.output
    assert "did not start" in res.output and "No such file" in res.output
    assert "no instance started" in res.output
    assert processes_with(marker) == []


def test_engines_die_with_a_killed_up(marker: str, tmp_path: Path) -> None:  # noqa: F811
    """Even `kill -9` of `flexpipe up` leaves no engine behind (PR_SET_PDEATHSIG)."""
    port = free_port()
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port), "--time-scale", "0.02",
        "--controller-port", str(free_port()),
        "--models", str(write_models(tmp_path, marker)),
        "--store", f"sqlite:///{tmp_path / 'fp.db'}",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    try:
        wait_for_line(proc, "serving", 90)
        assert len(engines_with(marker)) == 3
        proc.kill()
        proc.wait(timeout=10)
        deadline = time.monotonic() + 15
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(marker) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_with(marker):
            os.kill(pid, signal.SIGKILL)


def test_a_request_sent_while_the_engines_load_waits_for_them(
    marker: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    """While the first plan's engines load, the gateway holds their model: a request sent
    then waits for the cold start and is served, instead of a 404."""
    port = free_port()
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port), "--time-scale", "0.2",
        "--controller-port", str(free_port()),
        "--models", str(write_models(tmp_path, marker)),
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stdout or ()), daemon=True)
    reader.start()
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0, timeout=120)  # fmt: skip
        deadline = time.monotonic() + 60
        listed: list[str] = []
        while time.monotonic() < deadline and not listed:
            with contextlib.suppress(openai.APIConnectionError):
                listed = [m.id for m in client.models.list().data]
            time.sleep(0.05)
        assert listed == [marker], "".join(lines)  # held: listed before any engine is ready
        num_ready_at_send = sum(" ready at " in line for line in lines)
        t0 = time.monotonic()
        out = client.completions.create(model=marker, prompt="hello there", max_tokens=5)
        waited_s = time.monotonic() - t0
        assert out.usage is not None and out.usage.completion_tokens == 5
        assert num_ready_at_send == 0, "".join(lines)  # it was sent during the cold start
        assert waited_s > 1.0  # ~25 modelled s of engine load at time scale 0.2
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    reader.join(10)
    assert proc.returncode == 0, "".join(lines)[-3000:]
    assert processes_with(marker) == []

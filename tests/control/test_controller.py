"""The controller end to end, as a user runs it: `flexpipe up` on the seed's fragmented
cluster with sim engines, under steady streamed load. The other tenant leaves gpu1 (the
cluster file changes on disk): the TP2 instance on gpu1+gpu2 is re-planned with the larger
KV cache and batch and shifted live, make-before-break, with no failed request. Then the
shift log tells what happened."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import openai
from test_up import write_models

from flexpipe.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
SHIFT = """
shift:
  triggers:
    window_s: 30
    num_samples: 2
    cooldown_s: 5
    resource_settle_s: 1
    thresholds: {down_utilization: 0.0}   # this test is about the resource trigger
  # ... and the live shift, not its price: the in-place gap is priced at the cold start this
  # machine measured, which a loaded machine stretches past the gain of the default horizon
  pricing: {horizon_s: 7200}
"""


class Output:
    """The process's output, read by a thread so that waits can look at it."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def wait_for(self, needle: str, timeout_s: float, start: int = 0) -> int:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for n, line in enumerate(self.lines[start:], start):
                if needle in line:
                    return n
            time.sleep(0.05)
        raise AssertionError(f"no {needle!r} in output:\n{''.join(self.lines)}")

    @property
    def text(self) -> str:
        return "".join(self.lines)


def test_tenant_leaves_gpu1_and_the_tp2_instance_shifts_up_live(tmp_path: Path) -> None:
    cluster = tmp_path / "cluster.yaml"
    cluster.write_text((ROOT / "examples/clusters/fragmented-4gpu.yaml").read_text())
    (tmp_path / "shift.yaml").write_text(SHIFT)
    port = free_port()
    store = f"sqlite:///{tmp_path / 'fp.db'}"
    name = f"ctl-{os.getpid()}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port),
        "--controller-port", str(free_port()), "--time-scale", "0.05", "--tick-s", "0.5",
        "--cluster", str(cluster), "--models", str(write_models(tmp_path, name)),
        "--store", store, "--shift-config", str(tmp_path / "shift.yaml"),
        "--drain-timeout-s", "5",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    out = Output(proc)
    stop = threading.Event()
    results: list[str] = []

    async def load() -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                                    max_retries=0, timeout=60)  # fmt: skip

        async def one(i: int) -> None:
            while not stop.is_set():
                try:
                    text = ""
                    stream = await client.completions.create(
                        model=name, prompt=f"user {i} asks a question", max_tokens=24,
                        stream=True, extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    async for ch in stream:
                        text += ch.choices[0].text if ch.choices else ""
                    results.append("ok" if len(text.split()) >= 18 else f"short: {text!r}")
                except openai.APIError as exc:
                    results.append(f"error: {exc}")

        try:
            await asyncio.gather(*(one(i) for i in range(6)))
        finally:
            await client.close()

    loader = threading.Thread(target=lambda: asyncio.run(load()), daemon=True)
    try:
        out.wait_for("instance(s) serving", 90)
        assert "s48" in out.text and ("gpu2+gpu1" in out.text or "gpu1+gpu2" in out.text)
        loader.start()
        time.sleep(2)
        # the other tenant leaves gpu1
        text = cluster.read_text()
        cluster.write_text(text.replace("used_gib: 40", "used_gib: 0"))
        n = out.wait_for("controller: shift (resource)", 60)
        done = out.wait_for("controller: shift done", 90, n)
        time.sleep(1)
        stop.set()
        loader.join(60)
        after = "".join(out.lines[n:done])
        assert "s64" in after  # the bigger batch the freed KV cache allows
        failures = [r for r in results if r != "ok"]
        assert len(results) > 20 and failures == [], failures[:5]
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
        assert proc.returncode == 0, out.text[-3000:]
    finally:
        stop.set()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    shifts = subprocess.run(
        [sys.executable, "-m", "flexpipe", "shifts", "--store", store, "--json", "--limit", "0"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    entries = json.loads(shifts.stdout)
    entries = entries if isinstance(entries, list) else entries["entries"]
    done_shifts = [e for e in entries if e["kind"] == "shift" and e["outcome"] == "succeeded"]
    assert done_shifts and done_shifts[0]["trigger"] == "resource"
    assert any(e["kind"] == "resources" for e in entries)


def test_a_killed_controller_is_restarted_and_adopts_its_engines(tmp_path: Path) -> None:
    """kill -9 of the controller under load: the gateway and the engines keep serving, `up`
    starts a new controller, which adopts the running engines from the store (no second
    launch) and carries on; `kill -9` of `up` itself then leaves no process behind."""
    from test_launcher import processes_with
    from test_up import engines_with

    port = free_port()
    store = f"sqlite:///{tmp_path / 'fp.db'}"
    name = f"adopt-{os.getpid()}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--port", str(port),
        "--controller-port", str(free_port()), "--time-scale", "0.05", "--tick-s", "0.5",
        "--models", str(write_models(tmp_path, name)), "--store", store,
        "--drain-timeout-s", "5",
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            env=env)  # fmt: skip
    out = Output(proc)
    marker = str(tmp_path)
    try:
        out.wait_for("instance(s) serving", 90)
        engines = sorted(engines_with(name))  # their command lines name the served model
        assert len(engines) == 3
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="x",
                               max_retries=0)  # fmt: skip
        controllers = [p for p in processes_with(marker) if _is_controller(p)]
        assert len(controllers) == 1
        os.kill(controllers[0], signal.SIGKILL)
        for _ in range(10):  # served while no controller runs
            r = client.completions.create(model=name, prompt="still there?", max_tokens=4)
            assert r.usage is not None and r.usage.completion_tokens == 4
        out.wait_for("adopted 3 running instance(s)", 60)
        out.wait_for("instance(s) serving", 30, len(out.lines) - 5)
        assert sorted(engines_with(name)) == engines  # the same engines, none launched
        r = client.completions.create(model=name, prompt="and now?", max_tokens=4)
        assert r.usage is not None and r.usage.completion_tokens == 4
        proc.kill()  # kill -9 of up: everything it started goes
        proc.wait(10)
        deadline = time.monotonic() + 20
        while processes_with(marker) + processes_with(name) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert processes_with(marker) + processes_with(name) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in processes_with(marker) + processes_with(name):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def _is_controller(pid: int) -> bool:
    try:
        return b"\0controller\0" in Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False

"""The local launcher with real processes: the sim engine, the vLLM command path (pointed at
the sim engine, which takes the same flags), timeouts, early exits and process-group stops.
Every test checks that no process it started is left (by a unique marker in the argv)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from flexpipe.gears.gear import parse_gear
from flexpipe.http.client import ClientPool
from flexpipe.launch import (
    EngineExited,
    EngineNotReady,
    EngineSpec,
    LocalLauncher,
    free_port,
    vllm_flags,
)
from flexpipe.launch.health import health_ok
from flexpipe.launch.process import stop_group

SIM = (sys.executable, "-m", "flexpipe.engine.sim")


def processes_with(marker: str) -> list[int]:
    """Pids of live (not zombie) processes whose command line contains `marker`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmdline and state != "Z":
            pids.append(int(entry.name))
    return pids


@pytest.fixture
def marker() -> Iterator[str]:
    """A unique served-model-name; the test fails if a process carrying it survives."""
    mark = f"fp-test-{uuid.uuid4().hex[:10]}"
    yield mark
    left = processes_with(mark)
    for pid in left:
        os.kill(pid, 9)
    assert not left, f"processes left behind: {left}"


def spec(marker: str, gear: str = "tp=1,max_num_seqs=8", **kw: object) -> EngineSpec:
    return EngineSpec(
        "llama-2-7b",
        parse_gear(gear),
        name="t",
        served_model_name=marker,
        **kw,  # type: ignore[arg-type]
    )


def test_sim_engine_starts_serves_and_stops(marker: str, tmp_path: Path) -> None:
    async def main() -> None:
        launcher = LocalLauncher("sim", time_scale=0.01, log_dir=tmp_path)
        handle = await launcher.start(spec(marker))
        try:
            assert handle.returncode is None and handle.cold_start_s > 0
            client = openai.AsyncOpenAI(base_url=handle.endpoint + "/v1", api_key="x")
            out = await client.completions.create(model=marker, prompt="hello there", max_tokens=4)
            assert out.usage is not None and out.usage.completion_tokens == 4
            await client.close()
        finally:
            await handle.stop()
        assert handle.returncode is not None
        assert processes_with(marker) == []

    asyncio.run(main())


def test_vllm_path_passes_vllm_flags_and_cuda_visible_devices(marker: str, tmp_path: Path) -> None:
    launcher = LocalLauncher("vllm", vllm_command=SIM, log_dir=tmp_path)
    s = spec(marker, "tp=2,max_num_seqs=8", gpu_indices=(2, 3))
    argv, env = launcher.command(s, 8123)
    assert env["CUDA_VISIBLE_DEVICES"] == "2,3"
    assert (
        "--tensor-parallel-size" in argv and argv[argv.index("--tensor-parallel-size") + 1] == "2"
    )
    assert "--time-scale" not in argv  # no sim-only flag on the vLLM path
    assert argv[len(SIM) :] == vllm_flags(s, "127.0.0.1", 8123, real=True)
    assert argv[len(SIM)] == "meta-llama/Llama-2-7b-hf"  # vLLM loads weights, not a catalog id

    async def main() -> None:
        # The sim engine accepts exactly what `vllm serve` gets; the command's own prefix
        # adds a time scale so its ~30 s modelled load takes a fraction of a second.
        fast = LocalLauncher(
            "vllm",
            vllm_command=(*SIM, "--time-scale", "0.01"),
            log_dir=tmp_path,
        )
        handle = await fast.start(s)
        try:
            client = openai.AsyncOpenAI(base_url=handle.endpoint + "/v1", api_key="x")
            models = await client.models.list()
            assert [m.id for m in models.data] == [marker]
            await client.close()
        finally:
            await handle.stop()

    asyncio.run(main())


def test_engine_that_never_becomes_ready_times_out(marker: str, tmp_path: Path) -> None:
    launcher = LocalLauncher(
        "sim", time_scale=1.0, sim_load_time_s=1000, ready_timeout_s=1.5, log_dir=tmp_path
    )
    with pytest.raises(EngineNotReady, match=r"did not become ready .* within 1\.5 s"):
        asyncio.run(launcher.start(spec(marker)))
    assert processes_with(marker) == []


def test_engine_that_exits_before_ready_says_why(marker: str, tmp_path: Path) -> None:
    launcher = LocalLauncher("sim", time_scale=0.01, log_dir=tmp_path)
    big = EngineSpec(
        "llama-2-70b", parse_gear("tp=1"), name="big", gpu_type="L4", served_model_name=marker
    )
    with pytest.raises(EngineExited, match="exited before it became ready") as info:
        asyncio.run(launcher.start(big))
    assert info.value.returncode not in (None, 0)
    assert "GiB" in str(info.value)  # the engine's own reason, from its log
    assert processes_with(marker) == []


FAKE_ENGINE = """
import http.server, signal, subprocess, sys
signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a stubborn engine: needs SIGKILL
port = int(sys.argv[sys.argv.index("--port") + 1])
marker = sys.argv[sys.argv.index("--served-model-name") + 1]
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)", marker])
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.send_header("content-length", "2"); self.end_headers()
        self.wfile.write(b"ok")
    def log_message(self, *a): pass
http.server.HTTPServer(("127.0.0.1", port), H).serve_forever()
"""


def test_stop_kills_the_whole_process_group(marker: str, tmp_path: Path) -> None:
    script = tmp_path / "fake_engine.py"
    script.write_text(FAKE_ENGINE)

    async def main() -> None:
        launcher = LocalLauncher(
            "sim", sim_command=(sys.executable, str(script)), stop_grace_s=0.5, log_dir=tmp_path
        )
        handle = await launcher.start(spec(marker))
        for _ in range(50):  # the fake engine forks its child right away
            if len(processes_with(marker)) >= 2:
                break
            await asyncio.sleep(0.05)
        assert len(processes_with(marker)) == 2
        await handle.stop()
        assert processes_with(marker) == []

    asyncio.run(main())


LEADER_EXITS_CHILD_STAYS = """
import signal, subprocess, sys, time
marker = sys.argv[1]
subprocess.Popen([sys.executable, "-c",
                  "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                  "time.sleep(600)", marker])
time.sleep(600)  # SIGTERM ends it at once; its child ignores SIGTERM
"""


def test_stop_group_kills_what_outlives_a_leader_that_exits_in_time(
    marker: str, tmp_path: Path
) -> None:
    """The Ray actor and the test Ray cluster stop their processes with it."""
    script = tmp_path / "leader.py"
    script.write_text(LEADER_EXITS_CHILD_STAYS)
    proc = subprocess.Popen([sys.executable, str(script), marker], start_new_session=True)
    for _ in range(100):
        if len(processes_with(marker)) >= 2:
            break
        time.sleep(0.05)
    assert len(processes_with(marker)) == 2
    assert stop_group(proc, grace_s=5.0) == -signal.SIGTERM
    for _ in range(40):  # SIGKILL is delivered, the child reaped by init, a moment later
        if not processes_with(marker):
            break
        time.sleep(0.05)
    assert processes_with(marker) == []


def test_health_probe_is_false_when_nothing_listens_and_true_on_200(
    marker: str, tmp_path: Path
) -> None:
    async def main() -> None:
        pool = ClientPool()
        try:
            assert not await health_ok(pool, f"http://127.0.0.1:{free_port()}")
            launcher = LocalLauncher("sim", time_scale=0.01, log_dir=tmp_path)
            handle = await launcher.start(spec(marker))
            try:
                assert await health_ok(pool, handle.endpoint)
            finally:
                await handle.stop()
        finally:
            await pool.close()

    asyncio.run(main())

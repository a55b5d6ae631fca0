"""`flexpipe up --demo`: the load is a pure function of its seed, and the timeline runs as a
newcomer sees it — the first plan on the fragments (gpu1 held by the other tenant), the tenant
leaving after a (modelled) minute through the controller's admin API, a shift onto gpu1, no
request failed — against real processes at time scale 0.1."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from test_launcher import processes_with
from test_up import wait_for_line

from flexpipe.cluster import load_cluster
from flexpipe.demo import DEMO_GPU, DemoLoad, demo_cluster, requests
from flexpipe.examples import DEFAULT_CLUSTER
from flexpipe.launch import free_port


def test_requests_are_seeded_poisson_with_shared_prefixes() -> None:
    load = DemoLoad(rate_per_s=4.0, seed=3)
    first = list(itertools.islice(requests(load), 2000))
    assert first[:5] == list(itertools.islice(requests(load), 5))  # same seed, same load
    assert first[0] != next(requests(DemoLoad(rate_per_s=4.0, seed=4)))
    assert all(b.at_s > a.at_s for a, b in itertools.pairwise(first))
    rate = len(first) / first[-1].at_s
    assert 3.8 < rate < 4.2  # 2000 exponential gaps: within 5 % of the rate
    systems = {r.prompt.split("\n")[0] for r in first}
    assert len(systems) == load.num_system_prompts  # the prefix cache has something to hit
    lengths = {r.max_tokens for r in first}
    assert lengths == {load.short_output_tokens, load.long_output_tokens}


def test_the_demo_cluster_starts_without_gpu1() -> None:
    cluster = demo_cluster(load_cluster(DEFAULT_CLUSTER), 1000.0)
    gpu = cluster.gpu(DEMO_GPU)
    assert gpu.free_bytes == 0 and gpu.owner == "tenant-b (demo)"


def test_up_demo_starts_on_fragments_and_shifts_up(tmp_path: Path) -> None:
    port, cport = free_port(), free_port()
    store = f"sqlite:///{tmp_path / 'fp.db'}"
    argv = [
        sys.executable, "-m", "flexpipe", "up", "--demo", "--port", str(port),
        "--controller-port", str(cport), "--time-scale", "0.1", "--tick-s", "1",
        "--store", store,
    ]  # fmt: skip
    env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    )
    engine_ports: list[str] = []
    try:
        lines = wait_for_line(proc, "instance(s) serving", 120)
        started = "".join(lines)
        assert f"dashboard at http://127.0.0.1:{port}/ui" in started
        assert " on gpu1 " not in started  # the tenant holds it: the plan is the fragments
        lines += wait_for_line(proc, "the other tenant left gpu1", 60)
        lines += wait_for_line(proc, "controller: shift done", 120)
        t_done = time.monotonic()
        status = subprocess.run(
            [sys.executable, "-m", "flexpipe", "status", "--json",
             "--controller", f"http://127.0.0.1:{cport}"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr
        snap = json.loads(status.stdout)
        assert any(DEMO_GPU in i["gpus"] for i in snap["instances"])  # shifted onto gpu1
        engine_ports = [i["url"].rsplit(":", 1)[1] for i in snap["instances"]]
        while time.monotonic() - t_done < 3:  # the load runs on after the shift
            lines.append(proc.stdout.readline() if proc.stdout else "")
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = "".join(lines) + rest
    assert proc.returncode == 0, text[-3000:]
    reports = [line for line in text.splitlines() if line.startswith("demo: ") and " sent," in line]
    assert reports, text[-3000:]
    assert all(" 0 failed," in line for line in reports), reports
    assert "stopped the controller and the gateway" in rest
    time.sleep(1)
    assert processes_with(str(tmp_path)) == []  # the controller (its --store) is gone
    assert [p for e in engine_ports for p in processes_with(f"--port {e} ")] == []


def test_controller_occupy_of_an_unknown_gpu_is_one_line(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "flexpipe", "controller", "--occupy", "gpu9",
         "--port", str(free_port()), "--store", f"sqlite:///{tmp_path / 'fp.db'}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2
    assert res.stderr.strip().startswith("error: --occupy gpu9: no such GPU in ")
    assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr


def test_up_demo_with_a_cluster_file_is_refused(tmp_path: Path) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "flexpipe", "up", "--demo", "--cluster", str(DEFAULT_CLUSTER),
         "--store", f"sqlite:///{tmp_path / 'fp.db'}"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert res.returncode == 2 and "--demo runs the built-in example cluster" in res.stderr

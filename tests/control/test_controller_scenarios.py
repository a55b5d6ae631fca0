"""The controller end to end in the seed's scenarios (docs/controller.md) that
tests/control/test_controller.py does not cover, as a user runs them: `flexpipe up` on the seed's
fragmented cluster with sim engines (`--time-scale 0.05`), steady streamed load through the official
openai client, the cluster changed through the cluster file, the admin API or kill -9, and what
happened read back from the controller's status and the shift log in the store.

One `up` process serves the scenarios that can share it (occupy/release, planned reclaim,
GPU lost without notice); the rehearsal-failure and the down-shift scenarios need their own
settings (an impossible rehearsal tolerance; the down zone enabled), so their own process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_controller import Output
from test_up import write_models

from flexpipe.cli.run_dir import find_admin_token
from flexpipe.control.api.client import ControllerClient
from flexpipe.launch import free_port
from flexpipe.store import Store
from flexpipe.store.instance_registry import InstanceRegistry
from flexpipe.store.shift_entry import ShiftEntry
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parents[2]
FLEXPIPE = [sys.executable, "-m", "flexpipe"]


class Load:
    """`num_streams` clients, each streaming one completion after another until stopped."""

    def __init__(
        self,
        port: int,
        model: str,
        num_streams: int = 6,
        pause_s: float = 0.0,
        max_tokens: int = 24,
        prompt: str = "user {i} asks a question",
    ) -> None:
        self.port, self.model, self.num_streams = port, model, num_streams
        self.pause_s, self.max_tokens, self.prompt = pause_s, max_tokens, prompt
        self.results: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._run()), daemon=True)

    async def _run(self) -> None:
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{self.port}/v1", api_key="x",
                                    max_retries=0, timeout=60)  # fmt: skip

        async def one(i: int) -> None:
            while not self._stop.is_set():
                try:
                    text = ""
                    stream = await client.completions.create(
                        model=self.model, prompt=self.prompt.format(i=i),
                        max_tokens=self.max_tokens, stream=True, extra_body={"ignore_eos": True},
                    )  # fmt: skip
                    async for ch in stream:
                        text += ch.choices[0].text if ch.choices else ""
                    ok = len(text.split()) >= 0.75 * self.max_tokens
                    self.results.append("ok" if ok else f"short: {text!r}")
                except openai.APIError as exc:
                    self.results.append(f"error: {exc}")
                await asyncio.sleep(self.pause_s)

        try:
            await asyncio.gather(*(one(i) for i in range(self.num_streams)))
        finally:
            await client.close()

    def start(self) -> Load:
        self._thread.start()
        return self

    def stop(self) -> list[str]:
        self._stop.set()
        self._thread.join(60)
        return self.results

    def failures(self) -> list[str]:
        return [r for r in self.results if r != "ok"]


class Up:
    """A `flexpipe up` process with its cluster file, store and controller admin API."""

    def __init__(
        self,
        tmp_path: Path,
        shift_yaml: str,
        extra: tuple[str, ...] = (),
        drain_s: float = 3,
        models_yaml: str | None = None,  # with {name}: the model's name (unique per run)
        cluster_yaml: str | None = None,  # the cluster file (default: the seed's 4 GPUs)
    ) -> None:
        self.cluster = tmp_path / "cluster.yaml"
        default = (ROOT / "examples/clusters/fragmented-4gpu.yaml").read_text()
        self.cluster.write_text(default if cluster_yaml is None else cluster_yaml)
        (tmp_path / "shift.yaml").write_text(shift_yaml)
        self.port = free_port()
        self.controller_url = f"http://127.0.0.1:{free_port()}"
        self.store_url = f"sqlite:///{tmp_path / 'fp.db'}"
        self.model = f"scn-{os.getpid()}"
        if models_yaml is None:
            models = write_models(tmp_path, self.model)
        else:
            models = tmp_path / "models.yaml"
            models.write_text(models_yaml.format(name=self.model))
        argv = [
            *FLEXPIPE, "up", "--port", str(self.port),
            "--controller-port", self.controller_url.rsplit(":", 1)[1],
            "--time-scale", "0.05", "--tick-s", "0.5",
            "--cluster", str(self.cluster), "--models", str(models),
            "--store", self.store_url, "--shift-config", str(tmp_path / "shift.yaml"),
            "--drain-timeout-s", str(drain_s), *extra,
        ]  # fmt: skip
        env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)  # fmt: skip
        self.out = Output(self.proc)
        self.store = Store(self.store_url)

    @property
    def client(self) -> ControllerClient:
        """The controller's admin API, with the admin token `up` gave it (from its run dir)."""
        return ControllerClient(self.controller_url, find_admin_token(self.controller_url))

    def ready(self, timeout_s: float = 90) -> None:
        self.out.wait_for("instance(s) serving", timeout_s)

    def status(self) -> dict[str, Any]:
        doc: dict[str, Any] = self.client.status()
        return doc

    def gpus_in_use(self) -> set[str]:
        return {g for i in self.status()["instances"] for g in i["gpus"]}

    def entries(self, *kinds: str) -> list[ShiftEntry]:
        return ShiftLog(self.store).entries(kinds=kinds or None)

    def wait_until(self, what: str, check: Callable[[], Any], timeout_s: float) -> Any:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            got = check()
            if got:
                return got
            if self.proc.poll() is not None:
                break
            time.sleep(0.2)
        last = [f"{e.kind} {e.outcome}: {e.reason} {e.signals}" for e in self.entries()[-3:]]
        raise AssertionError(
            f"timed out waiting for {what}; output:\n{self.out.text[-4000:]}\nlast entries:\n"
            + "\n".join(last)
        )

    def set_gpu(self, gpu: str, **fields: Any) -> None:
        """Rewrite one GPU's entry of the cluster file (the controller watches it)."""
        doc = yaml.safe_load(self.cluster.read_text())
        for node in doc["nodes"]:
            for g in node["gpus"]:
                if g["id"] == gpu:
                    g.update(fields)
        self.cluster.write_text(yaml.safe_dump(doc, sort_keys=False))

    def engine_pid(self, gpu: str) -> int:
        for rec in InstanceRegistry(self.store).live_instances():
            if gpu in rec.gpu_ids and rec.state == "active" and rec.pid is not None:
                return rec.pid
        raise AssertionError(f"no live instance on {gpu} in the store")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.store.close()


def new_entries(up: Up, seen: int, kind: str) -> list[ShiftEntry]:
    return [e for e in up.entries()[seen:] if e.kind == kind]


def finished(entries: list[ShiftEntry]) -> list[ShiftEntry]:
    return [e for e in entries if e.outcome not in ("pending", "noted")]


SHARED = """
shift:
  triggers:
    window_s: 30
    num_samples: 2
    cooldown_s: 2
    resource_settle_s: 1
    reclaim_lead_s: 60
    thresholds: {down_utilization: 0.0}   # load-driven shifts are not what these test
  # nor the price of the re-plans they wait for: the in-place gap is priced at the cold start
  # this machine measured, which a loaded machine stretches past the default horizon's gain
  pricing: {horizon_s: 7200}
"""


@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Up, Load]]:
    # a short drain deadline: answers still running at it are moved (KV or recompute)
    up = Up(tmp_path_factory.mktemp("shared"), SHARED, drain_s=0.3)
    load: Load | None = None
    try:
        up.ready()
        load = Load(up.port, up.model).start()
        time.sleep(1.5)
        yield up, load
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


def test_occupy_then_release_gpu3_vacates_it_then_uses_it_again(shared: tuple[Up, Load]) -> None:
    up, load = shared
    assert "gpu3" in up.gpus_in_use()
    seen = len(up.entries())
    num_results = len(load.results)
    occupy = subprocess.run(
        [*FLEXPIPE, "cluster", "occupy", "gpu3", "--controller", up.controller_url],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert occupy.returncode == 0, occupy.stdout + occupy.stderr
    vacated = up.wait_until(
        "the instance on gpu3 vacated",
        lambda: finished(new_entries(up, seen, "reclaim")),
        60,
    )
    assert vacated[0].outcome == "succeeded", vacated[0]
    assert "gpu3" not in up.gpus_in_use()
    seen = len(up.entries())
    release = subprocess.run(
        [*FLEXPIPE, "cluster", "release", "gpu3", "--controller", up.controller_url],
        capture_output=True, text=True, timeout=30,
    )  # fmt: skip
    assert release.returncode == 0, release.stdout + release.stderr
    # the re-plan may relaunch other instances too, one group at a time: wait for its end
    shifts = up.wait_until(
        "a finished shift with gpu3 in use again",
        lambda: finished(new_entries(up, seen, "shift")) if "gpu3" in up.gpus_in_use() else [],
        120,
    )
    assert shifts and shifts[-1].outcome == "succeeded" and shifts[-1].trigger == "resource"
    time.sleep(1)
    assert len(load.results) > num_results + 10
    assert load.failures() == [], load.failures()[:5]


def test_engine_killed_without_notice_is_an_emergency_and_no_request_fails(
    shared: tuple[Up, Load],
) -> None:
    up, load = shared
    up.wait_until("the A100s serving", lambda: {"gpu1", "gpu2"} <= up.gpus_in_use(), 120)
    before = up.gpus_in_use()
    assert {"gpu1", "gpu2"} <= before
    seen = len(up.entries())
    num_results = len(load.results)
    victim = "gpu3" if "gpu3" in before else "gpu1"
    os.kill(up.engine_pid(victim), signal.SIGKILL)
    emergency = up.wait_until("an emergency entry", lambda: new_entries(up, seen, "emergency"), 30)
    assert "re-planned" in emergency[0].reason
    # re-planned: a new instance on the freed GPUs, or the others carry the load
    up.wait_until("the freed GPU used again", lambda: victim in up.gpus_in_use(), 60)
    time.sleep(1)
    assert len(load.results) > num_results + 10
    assert load.failures() == [], load.failures()[:5]


def in_flight_by_url(up: Up) -> dict[str, float]:
    """Requests in flight per instance URL, from the gateway's public /metrics."""
    with urllib.request.urlopen(f"http://127.0.0.1:{up.port}/metrics", timeout=10) as resp:
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "flexpipe_in_flight_requests":
            for sample in family.samples:
                out[sample.labels["instance"]] = sample.value
    return out


def busiest_instance(up: Up) -> tuple[dict[str, Any], dict[str, float]]:
    """The controller's view of the instance with the most requests in flight (at least 2),
    so that a reclaim of its GPU has requests to move."""

    def busiest() -> tuple[dict[str, Any], dict[str, float]] | None:
        in_flight = in_flight_by_url(up)
        instances: list[dict[str, Any]] = up.status()["instances"]
        best = max(instances, key=lambda i: in_flight.get(i["url"], 0.0))
        return (best, in_flight) if in_flight.get(best["url"], 0.0) >= 2 else None

    found: tuple[dict[str, Any], dict[str, float]] = up.wait_until("a busy instance", busiest, 10)
    return found


def test_planned_reclaim_vacates_the_gpu_before_its_lease_ends(shared: tuple[Up, Load]) -> None:
    up, load = shared
    # long answers too (seconds of wall time each, many drain deadlines): those running on
    # the reclaimed instance at the deadline must be moved (distinct first prompt blocks: the
    # gateway's prefix affinity spreads them)
    prompt = "{i} " * 40 + "tell a long story"
    long = Load(up.port, up.model, num_streams=8, max_tokens=3500, prompt=prompt).start()
    try:
        time.sleep(2)
        victim, in_flight = busiest_instance(up)
        gpu = victim["gpus"][0]
        seen = len(up.entries())
        deadline_s = time.time() + 40
        up.set_gpu(gpu, free_until_s=round(deadline_s))
        done = up.wait_until(
            f"the instance on {gpu} vacated",
            lambda: finished(new_entries(up, seen, "reclaim")),
            40,
        )
        time.sleep(1)
    finally:
        long.stop()
    entry = done[0]
    assert entry.outcome == "succeeded", entry
    assert entry.finished_at is not None and entry.finished_at.timestamp() < deadline_s
    assert entry.target is not None and all(gpu not in i.gpu_ids for i in entry.target)
    assert gpu not in up.gpus_in_use()
    logged = _json_entries(up.store_url, "reclaim")
    assert any(f"{gpu} is reclaimed in" in e["reason"] for e in logged), logged
    # what still ran on it finished in place by the drain deadline or was moved, and the
    # shift log counts each by method. (How many still run when the drain starts varies:
    # the cluster file is polled every 2 s and routing decides where the long answers go;
    # runs here saw from 0 to 4, recomputed or finished in place.)
    m = entry.migrated
    print(f"reclaim of {gpu} ({victim['gear']}, in flight before: {in_flight}): {m}")
    assert m is not None
    # none failed
    assert long.results and long.failures() == [], long.failures()[:5]
    assert load.failures() == [], load.failures()[:5]


def _json_entries(store_url: str, kind: str) -> list[dict[str, Any]]:
    shifts = subprocess.run(
        [*FLEXPIPE, "shifts", "--store", store_url, "--json", "--kind", kind],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    doc = json.loads(shifts.stdout)
    entries: list[dict[str, Any]] = doc if isinstance(doc, list) else doc["entries"]
    return entries


REHEARSAL = """
shift:
  triggers:
    window_s: 30
    num_samples: 2
    cooldown_s: 1
    resource_settle_s: 0.5
    max_failures: 2
    failure_window_s: 600
    blacklist_s: 900
    thresholds: {down_utilization: 0.0}
    # the light test load is covered by either plan: the freed gpu1 must not need a goodput
    # gain to be tried (this test is about what happens when the try fails)
    resource_min_gain_fraction: 0.0
  # and the in-place gap must not outweigh it at this load; a try that gives a GPU back must
  # not need the headroom a down-shift keeps over the declared rate
  pricing: {horizon_s: 7200, down_headroom: 0}
"""


def test_a_target_that_fails_rehearsal_is_rolled_back_then_blacklisted(tmp_path: Path) -> None:
    up = Up(tmp_path, REHEARSAL, ("--rehearsal-tolerance", "0.001"))
    load: Load | None = None
    try:
        up.ready()
        before = {i["key"] for i in up.status()["instances"]}
        load = Load(up.port, up.model).start()
        time.sleep(1)
        up.set_gpu("gpu1", used_gib=0)  # the other tenant leaves gpu1
        rolled = up.wait_until(
            "two rolled-back shifts",
            lambda: [e for e in finished(up.entries("shift")) if e.outcome == "rolled_back"][1:],
            60,
        )
        both = [e for e in up.entries("shift") if e.outcome == "rolled_back"]
        assert all(e.trigger == "resource" and "rehearsal missed" in (e.error or "") for e in both)
        assert all(e.rehearsal and not all(c.passed for c in e.rehearsal) for e in both)
        assert rolled
        # then it is blacklisted: a decision refuses it by name. Under load the tries may
        # differ (the measured rate moves the gear) and the blacklist counts the instances
        # whose rehearsal missed (`finished_record`), so a key may need a third try to fail
        # twice: what the first such hold names is what failed twice before it.
        hold = up.wait_until(
            "a hold that names the blacklist",
            lambda: [
                e
                for e in up.entries("hold")
                if any("blacklisted until" in a.reason for a in e.alternatives)
            ],
            40,
        )[0]
        named = {
            key.strip()
            for a in hold.alternatives
            if "blacklisted until" in a.reason
            for key in a.reason.split(": ", 1)[1].split(", ")
        }
        tried = [
            e
            for e in up.entries("shift")
            if e.outcome == "rolled_back" and e.finished_at is not None and e.finished_at <= hold.at
        ]
        num_failures = Counter(c.instance for e in tried for c in e.rehearsal if not c.passed)
        banned = {key for key, n in num_failures.items() if n >= 2}
        assert named and named <= banned, (named, num_failures)
        time.sleep(3)  # six more ticks
        # what failed twice is never tried again (another plan without it may be)
        later = [e for e in up.entries("shift") if e.at > hold.at]
        assert all(not banned & {i.key for i in e.target or ()} for e in later), [
            (e.trigger, e.outcome, e.reason, [i.key for i in e.target or ()], banned) for e in later
        ]
        if not later:
            # the old plan serves again: the target is in place (TP2 s64 on the GPUs of TP2
            # s48), so the old instance was released before the rehearsal and started again
            assert {i["key"] for i in up.status()["instances"]} == before
        up.wait_until(
            "every instance active",
            lambda: all(i["state"] == "active" for i in up.status()["instances"]),
            120,
        )
        results = load.stop()
        assert len(results) > 20 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]


DOWN = """
shift:
  triggers:
    window_s: 30
    num_samples: 4
    cooldown_s: 30
"""


def test_sustained_low_load_shifts_down_after_n_samples_and_frees_gpus(tmp_path: Path) -> None:
    up = Up(tmp_path, DOWN)
    load: Load | None = None
    try:
        up.ready()
        before = up.gpus_in_use()
        # one request a second: far below what the three instances carry. (The controller
        # measures the arrival rate per wall second and compares it with capacities per
        # modelled second; at --time-scale 0.05 back-to-back streams look 20x busier.)
        load = Load(up.port, up.model, num_streams=1, pause_s=1.0).start()
        done = up.wait_until("a down-shift", lambda: finished([e for e in up.entries("shift")]), 60)
        shift = done[0]
        assert shift.trigger == "down" and shift.outcome == "succeeded", shift
        # only after 4 samples in a row in the down zone: the holds just before it counted
        # up (a sample out of the zone while the machine stalls restarts the count: the
        # run's end is what the rule is about)
        holds = [e for e in up.entries("hold") if e.at < shift.at]
        runs = [s.run for e in holds for s in e.signals if s.zone == "down"]
        assert runs[-3:] == [1, 2, 3], runs
        down_signal = next(s for s in shift.signals if s.model == up.model)
        assert down_signal.zone == "down" and down_signal.run >= 4
        after = up.gpus_in_use()
        assert len(after) < len(before) and after < before
        assert len(up.status()["instances"]) >= 1
        time.sleep(1)
        results = load.stop()
        assert len(results) >= 2 and load.failures() == [], load.failures()[:5]
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert up.proc.returncode == 0, up.out.text[-3000:]

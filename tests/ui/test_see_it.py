"""See it, against real processes: one `flexpipe up` (sim engines, time scale 0.02) serves
`flexpipe status --json` and `flexpipe top`, and the Grafana board's every metric is checked
against the /metrics the gateway, the controller and each engine really export (the engines
found the way Prometheus finds them: the controller's HTTP service discovery)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from test_launcher import processes_with
from test_up import wait_for_line, write_models
from typer.testing import CliRunner

from flexpipe.cli import app
from flexpipe.cli.run_dir import find_admin_token
from flexpipe.control.core.targets import SD_PATH, http_sd_targets
from flexpipe.launch import free_port

ROOT = Path(__file__).resolve().parents[2]
BOARD = ROOT / "deploy" / "grafana" / "flexpipe.json"
SCRAPE = ROOT / "deploy" / "prometheus" / "prometheus.yml"


class Up:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp  # its TMPDIR: its run directory is found there, not another `up`'s
        self.marker = f"fp-see-{uuid.uuid4().hex[:10]}"
        self.port, self.cport = free_port(), free_port()
        self.store = f"sqlite:///{tmp / 'fp.db'}"
        argv = [
            sys.executable, "-m", "flexpipe", "up", "--port", str(self.port),
            "--controller-port", str(self.cport), "--time-scale", "0.02",
            "--tick-s", "600",  # no shift while the test reads the plan
            "--models", str(write_models(tmp, self.marker)), "--store", self.store,
        ]  # fmt: skip
        self.proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**self.env, "PYTHONUNBUFFERED": "1"},
        )  # fmt: skip

    @property
    def env(self) -> dict[str, str]:
        """The environment of `up` and of the commands run against it: no controller URL or
        token given, its run directory in its own TMPDIR."""
        drop = ("FLEXPIPE_CONTROLLER", "FLEXPIPE_CONTROLLER_TOKEN")
        env = {k: v for k, v in os.environ.items() if k not in drop}
        return {**env, "COLUMNS": "200", "TMPDIR": str(self.tmp)}

    @property
    def controller(self) -> str:
        return f"http://127.0.0.1:{self.cport}"

    @property
    def token(self) -> str | None:
        """The admin token of the controller (`up` gives it the gateway's)."""
        return find_admin_token(self.controller, self.tmp)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        left = processes_with(self.marker)
        for pid in left:
            os.kill(pid, signal.SIGKILL)
        assert not left, f"processes left behind: {left}"


@pytest.fixture(scope="module")
def up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Up]:
    u = Up(tmp_path_factory.mktemp("see-it"))
    try:
        wait_for_line(u.proc, "serving", 90)
        # the dashboard reads the engines every 2 s and counts from its first reading of
        # each: let it have one, so that the requests below fall in its window
        time.sleep(4)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{u.port}/v1", api_key="x")
        for i in range(6):  # streamed: the gateway observes TTFT and TPOT
            stream = client.completions.create(
                model=u.marker, prompt=f"the same long prefix of a prompt {i}", max_tokens=6,
                stream=True,
            )  # fmt: skip
            assert sum(1 for _ in stream) >= 1
        yield u
    finally:
        u.stop()


def _get(url: str, token: str | None = None) -> str:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=10) as resp:
        body: bytes = resp.read()
        return body.decode()


def _status(up: Up) -> dict[str, Any]:
    """`flexpipe status --json`, once the gateway's dashboard has read the requests the
    fixture sent (one reading every 2 s): the models' figures are the dashboard's."""
    deadline = time.monotonic() + 20
    while True:
        res = subprocess.run(
            [sys.executable, "-m", "flexpipe", "status", "--json", "--controller", up.controller],
            capture_output=True, text=True, timeout=60, env=up.env,
        )  # fmt: skip
        assert res.returncode == 0, res.stderr
        snap: dict[str, Any] = json.loads(res.stdout)
        model = snap["models"][0]
        if model["ttft_p95_s"] is not None and model["prefix_hit_rate"] is not None:
            return snap
        if time.monotonic() > deadline:
            return snap
        time.sleep(0.5)


def test_status_json_from_the_running_processes(up: Up) -> None:
    snap = _status(up)
    assert snap["cluster"] == "fragmented-4gpu" and snap["engine"] == "sim"
    assert json.loads(_get(up.controller + "/admin/status", up.token))["store"] == up.store
    assert snap["gateway_url"] == f"http://127.0.0.1:{up.port}" and snap["gateway_up"]
    instances = snap["instances"]
    # the seed's plan: TP2 over the NVLinked pair, one instance on each lone GPU
    assert sorted("+".join(sorted(i["gpus"])) for i in instances) == ["gpu0", "gpu1+gpu2", "gpu3"]
    assert {(i["model"], i["state"], i["health"]) for i in instances} == {
        (up.marker, "active", "ok")
    }
    assert all(i["max_num_seqs"] and i["kv_usage"] is not None for i in instances)
    (model,) = snap["models"]
    assert model["name"] == up.marker and model["num_instances"] == 3
    assert (model["ttft_slo_s"], model["tpot_slo_s"]) == (2.0, 0.06)
    assert model["error_rate"] == 0.0 and model["ttft_p95_s"] is not None
    assert model["prefix_hit_rate"] is not None and model["measured"]
    # from one reading: the dashboard's figures, tokens and the sim engines' busy time too
    assert model["generation_tokens_per_s"] > 0 and model["gpu_utilization"] is not None
    on = {g["id"]: g["instance"] for g in snap["gpus"]}
    assert on["gpu1"] == on["gpu2"] is not None and on["gpu0"] is not None


def test_top_draws_a_frame(up: Up) -> None:
    res = subprocess.run(
        [sys.executable, "-m", "flexpipe", "top", "--frames", "1", "--interval", "0.5",
         "--controller", up.controller],  # the shift log: where the controller writes it
        capture_output=True, text=True, timeout=60, env=up.env,
    )  # fmt: skip
    assert res.returncode == 0, res.stderr
    assert "flexpipe top" in res.stdout and up.marker in res.stdout
    assert "first plan" in res.stdout  # the shift log's plan entry, drawn as `flexpipe shifts`


def test_status_and_cluster_find_the_running_up_on_its_ports(up: Up) -> None:
    """`up` was given --port and --controller-port: `flexpipe status` and `flexpipe cluster
    release`, given no URL, find its controller (not 127.0.0.1:8100) and its token."""
    res = subprocess.run([sys.executable, "-m", "flexpipe", "status", "--json"],
                         capture_output=True, text=True, timeout=60, env=up.env)  # fmt: skip
    assert res.returncode == 0, res.stderr
    snap = json.loads(res.stdout)
    assert snap["controller_url"] == up.controller
    assert snap["gateway_url"] == f"http://127.0.0.1:{up.port}"
    res = subprocess.run([sys.executable, "-m", "flexpipe", "cluster", "release", "gpu3"],
                         capture_output=True, text=True, timeout=60, env=up.env)  # fmt: skip
    # the controller's own answer (gpu3 was never occupied): it was reached, with the token
    assert res.returncode == 1 and "is not occupied through the admin API" in res.stderr


def test_status_without_a_controller_is_one_line() -> None:
    res = CliRunner().invoke(app, ["status", "--controller", f"http://127.0.0.1:{free_port()}"])
    assert res.exit_code == 1
    lines = res.output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach the controller at")


# ------------------------------------------------------------------ the Grafana board

_NOT_METRICS = {
    "sum", "avg", "max", "min", "count", "rate", "irate", "increase", "changes",
    "histogram_quantile", "and", "or", "unless", "bool", "offset",
}  # fmt: skip


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads (or a Grafana label_values query)."""
    m = re.fullmatch(r"\s*label_values\(\s*([A-Za-z_:][\w:]*)\s*,.*\)\s*", expr)
    if m:
        return {m.group(1)}
    e = re.sub(r'"[^"]*"', "", expr)  # label values
    e = re.sub(r"\{[^}]*\}", "", e)  # label matchers
    e = re.sub(r"\[[^\]]*\]", "", e)  # ranges
    e = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    e = re.sub(r"\$\w+", "", e)  # Grafana variables
    return {n for n in re.findall(r"[A-Za-z_:][\w:]*", e) if n not in _NOT_METRICS}


def board_expressions(board: dict[str, Any]) -> list[str]:
    exprs = [t["expr"] for p in board["panels"] for t in p.get("targets", [])]
    exprs += [a["expr"] for a in board["annotations"]["list"] if "expr" in a]
    for var in board["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            exprs.append(query["query"])
    return exprs


def exported(text: str) -> set[str]:
    """Every series name an exposition can carry, by family type."""
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "counter": ("_total",),
                "summary": ("", "_sum", "_count")}  # fmt: skip
    out = set()
    for family in text_string_to_metric_families(text):
        out |= {family.name + s for s in suffixes.get(family.type, ("",))}
    return out


def test_metric_names_of_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model) (rate(a_bucket{model=~"$model"}'
        '[$__rate_interval]))) / sum without (x) (vllm:b_total{k="v"}) > 0'
    )
    assert metric_names(expr) == {"a_bucket", "vllm:b_total"}
    assert metric_names("label_values(vllm:num_requests_running, model_name)") == {
        "vllm:num_requests_running"
    }


def test_every_metric_the_board_queries_is_exported(up: Up) -> None:
    board = json.loads(BOARD.read_text())
    wanted = set().union(*(metric_names(e) for e in board_expressions(board)))
    # the five numbers, per model and per instance, and the shifts
    assert {
        "flexpipe_time_to_first_token_seconds_bucket",
        "flexpipe_time_per_output_token_seconds_bucket",
        "vllm:num_requests_waiting", "vllm:prefix_cache_hits_total",
        "flexpipe:modelled_busy_seconds_total", "vllm:time_to_first_token_seconds_bucket",
        "flexpipe_shifts_total", "flexpipe_shift_phase_seconds_bucket", "flexpipe_slo_seconds",
    } <= wanted  # fmt: skip
    targets = json.loads(_get(up.controller + SD_PATH, up.token))
    status = json.loads(_get(up.controller + "/admin/status", up.token))
    assert sorted(t for g in targets for t in g["targets"]) == sorted(
        i["url"].removeprefix("http://") for i in status["instances"]
    )
    texts = [_get(f"http://127.0.0.1:{up.port}/metrics"), _get(up.controller + "/metrics")]
    texts += [_get(f"http://{g['targets'][0]}/metrics") for g in targets]
    have = set().union(*(exported(t) for t in texts))
    # NVIDIA's dcgm-exporter's series come from outside flexpipe (tests/ui/test_dcgm.py checks
    # them against a recorded exposition)
    assert sorted(n for n in wanted - have if not n.startswith("DCGM_")) == []


def test_the_scrape_config_points_at_what_up_serves() -> None:
    doc = yaml.safe_load(SCRAPE.read_text())
    jobs = {j["job_name"]: j for j in doc["scrape_configs"]}
    assert jobs["flexpipe-gateway"]["static_configs"][0]["targets"] == ["127.0.0.1:8000"]
    assert jobs["flexpipe-controller"]["static_configs"][0]["targets"] == ["127.0.0.1:8100"]
    (sd,) = jobs["flexpipe-engines"]["http_sd_configs"]
    assert sd["url"] == "http://127.0.0.1:8100" + SD_PATH


def test_http_sd_targets_label_each_instance() -> None:
    doc = {"name": "m-0", "model": "m", "gear": "tp2-pp1-bf16-kvauto-s48", "gpus": ["gpu2", "gpu1"],
           "url": "http://127.0.0.1:9001", "state": "active"}  # fmt: skip
    assert http_sd_targets([doc, {**doc, "url": "not a url"}]) == [
        {
            "targets": ["127.0.0.1:9001"],
            "labels": {"flexpipe_instance": "m-0", "model": "m", "gear": "tp2-pp1-bf16-kvauto-s48",
                       "gpus": "gpu2+gpu1", "state": "active"},
        }
    ]  # fmt: skip


def test_the_board_is_well_formed() -> None:
    """What Grafana needs to import and lay it out: unique ids, 24 columns, every panel on the
    chosen data source with queries, panels that do not overlap."""
    board = json.loads(BOARD.read_text())
    panels = board["panels"]
    assert len({p["id"] for p in panels}) == len(panels)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24, p["title"]
        mine = {(g["y"] + dy, g["x"] + dx) for dy in range(g["h"]) for dx in range(g["w"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == "${datasource}" and p["targets"], p["title"]
        assert len({t["refId"] for t in p["targets"]}) == len(p["targets"])
    names = [v["name"] for v in board["templating"]["list"]]
    assert names == ["datasource", "model"]
    shifts = [a for a in board["annotations"]["list"] if a.get("name") == "Shifts"]
    assert len(shifts) == 1 and "flexpipe_shifts_total" in shifts[0]["expr"]

"""GPU utilisation from real GPUs, end to end on real sockets: a DCGM exporter on 127.0.0.1
serving the recorded exposition (tests/data/dcgm_exposition.txt), a controller's GPU map
(`topology_doc` of the seed cluster, served as the controller serves it), a real gateway
configured with both, vLLM-like fake engines and a real sim engine. The view's figure is the
exact mean of the recorded values on the model's GPUs, source "dcgm"; the sim engine's stays
"modelled"; `flexpipe status` shows the same; a dead exporter is skipped, said once, and the
gateway (its OpenAI API too) keeps serving."""

from __future__ import annotations

import http.client
import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from test_gateway_fakes import FakeEngine, LoopThread, free_port
from test_observe import _text

from flexpipe.cluster import load_cluster
from flexpipe.control.api.ui_api import UiInstance, topology_doc
from flexpipe.engine.testing import EngineProc, sim_engine
from flexpipe.examples import DEFAULT_CLUSTER
from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import ConfigError, config_from_dict
from flexpipe.http.server import App, HttpServer, Request, Response, json_response, serve
from flexpipe.observe.readings import Readings
from flexpipe.observe.render import models_table
from flexpipe.observe.status_snapshot import snapshot

EXPOSITION = (Path(__file__).parents[1] / "data" / "dcgm_exposition.txt").read_bytes()
INTERVAL_S = 0.1
SIM_MODEL = "llama-2-7b"
# the recorded busy fractions: node1's A100s (GR_ENGINE_ACTIVE), node2's L40S (GPU_UTIL / 100)
NODE1_GPU0, NODE1_GPU1, NODE2_GPU0 = 0.912345, 0.604118, 0.35


def static_server(lt: LoopThread, routes: dict[str, Callable[[], Response]]) -> HttpServer:
    """A server on 127.0.0.1 answering GET on each path: a DCGM exporter, a controller."""
    app = App()
    for path, answer in routes.items():

        async def handler(req: Request, answer: Callable[[], Response] = answer) -> Response:
            del req
            return answer()

        app.add_route("GET", path, handler)
    return lt.run(serve(app, "127.0.0.1", 0))


def url_of(server: HttpServer) -> str:
    return f"http://127.0.0.1:{server.port}"


@pytest.fixture(scope="module")
def sim() -> Iterator[EngineProc]:
    with sim_engine([SIM_MODEL, "--load-time-s", "0", "--time-scale", "0"]) as eng:
        yield eng


class Cluster:
    """Two vLLM-like engines of `fake-model` (one on node1's A100 pair, one on node0's GPU that
    no exporter watches) and a sim engine on node2's L40S, which DCGM also reports; the
    controller's GPU map places them, at time scale 0.5."""

    def __init__(self, lt: LoopThread, sim: EngineProc, dcgm_urls: list[str], **cfg: Any) -> None:
        self.lt = lt
        self.engines = [lt.run(FakeEngine().start()) for _ in range(2)]
        a, b = (e.url for e in self.engines)
        instances = [
            UiInstance("k1", "fake-0", "fake-model", "tp2", (("gpu1", "gpu2"),), a, "active"),
            UiInstance("k2", "fake-1", "fake-model", "tp1", (("gpu0",),), b, "active"),
            UiInstance("k3", "sim-0", SIM_MODEL, "tp1", (("gpu3",),), sim.url, "active"),
        ]
        topo = topology_doc(load_cluster(DEFAULT_CLUSTER), instances, [], time_scale=0.5)
        shifts = {"deployment": "test", "entries": []}
        self.controller = static_server(lt, {
            "/admin/topology": lambda: json_response(topo),
            "/admin/shifts": lambda: json_response(shifts),
        })  # fmt: skip
        data = {
            "backends": [{"url": a}, {"url": b}, {"url": sim.url}],
            "ui_interval_s": INTERVAL_S,
            "controller_url": url_of(self.controller),
            "dcgm_urls": dcgm_urls,
            **cfg,
        }
        self.gw = Gateway(config_from_dict(data))
        self.port = lt.run(self.gw.start("127.0.0.1", 0)).port

    def view(self) -> dict[str, Any]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
        try:
            conn.request("GET", "/ui/api/view")
            resp = conn.getresponse()
            assert resp.status == 200
            doc: dict[str, Any] = json.loads(resp.read())
            return doc
        finally:
            conn.close()

    def close(self) -> None:
        self.lt.run(self.gw.close())
        for e in self.engines:
            self.lt.run(e.stop())
        self.lt.run(self.controller.close())


def now_of(view: dict[str, Any], model: str) -> dict[str, Any]:
    found = [m["now"] for m in view["models"] if m["name"] == model]
    return (found[0] if found else None) or {}


def wait_for_view(c: Cluster, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        v = c.view()
        if ok(v):
            return v
        time.sleep(INTERVAL_S / 2)
    raise AssertionError(f"the view never got there: {json.dumps(v)[:2000]}")


def sourced(v: dict[str, Any]) -> bool:
    return all(now_of(v, m).get("gpu_utilization_source") for m in ("fake-model", SIM_MODEL))


def test_a_models_gpu_utilisation_is_the_mean_dcgm_measured_on_its_gpus(
    lt: LoopThread, sim: EngineProc
) -> None:
    exporter = static_server(lt, {"/metrics": lambda: Response(EXPOSITION)})
    c = Cluster(lt, sim, [url_of(exporter)])
    try:
        v = wait_for_view(c, sourced)
        fake = now_of(v, "fake-model")
        # the mean over its GPUs that an exporter reports (node0's has none), unscaled by the
        # time scale: DCGM measures wall time on the GPUs
        mean = (NODE1_GPU0 + NODE1_GPU1) / 2
        assert (fake["gpu_utilization"], fake["gpu_utilization_source"]) == (
            round(mean, 4), "dcgm")  # fmt: skip
        # the sim engine's GPU is reported too (0.35), but its figure is its modelled one
        assert now_of(v, SIM_MODEL)["gpu_utilization_source"] == "modelled"
        by_url = {i["url"]: i for i in v["instances"]}
        a, b = (by_url[e.url] for e in c.engines)
        assert (a["gpu_utilization"], a["gpu_utilization_source"]) == (round(mean, 4), "dcgm")
        assert (b["gpu_utilization"], b["gpu_utilization_source"]) == (None, None)
        assert by_url[sim.url]["gpu_utilization_source"] is None
        assert v["dcgm"] == {"exporters": [{"url": url_of(exporter), "num_gpus": 3, "error": None}]}
        # every series point carries the reading at its end: the same gauges each time
        points = [p["models"]["fake-model"] for p in v["series"] if "fake-model" in p["models"]]
        assert {(p["gpu_utilization"], p["gpu_utilization_source"]) for p in points[-3:]} == {
            (round(mean, 4), "dcgm")
        }

        # `flexpipe status` reads this view: the same figure, its source, the note under it
        status = {
            "gateway": f"http://127.0.0.1:{c.port}",
            "engine": "vllm",
            "instances": [
                {
                    "name": "fake-0",
                    "model": "fake-model",
                    "gear": "tp2",
                    "gpus": ["gpu1", "gpu2"],
                    "url": c.engines[0].url,
                    "state": "active",
                },
            ],
            "models": [{"name": "fake-model"}, {"name": SIM_MODEL}],
        }
        snap = snapshot(Readings(time.time(), url_of(c.controller), status, "", {}, v))
        m, s = snap.models
        assert (m.gpu_utilization, m.gpu_utilization_source) == (round(mean, 4), "dcgm")
        assert s.gpu_utilization_source == "modelled"
        (i,) = snap.instances  # its engine's own window is not there: the view's DCGM figure
        assert (i.gpu_utilization, i.gpu_utilization_source) == (round(mean, 4), "dcgm")
        doc = snap.to_json()
        assert doc["models"][0]["gpu_utilization_source"] == "dcgm"
        assert doc["instances"][0]["gpu_utilization_source"] == "dcgm"
        drawn = " ".join(_text(models_table(snap)).split())
        assert "GPU util of fake-model: measured on its GPUs by DCGM" in drawn
        assert f"GPU util of {SIM_MODEL}: its sim engines' modelled busy time" in drawn
    finally:
        c.close()
        lt.run(exporter.close())


def test_the_gpu_busy_metric_falls_back_to_gpu_util_and_hostnames_map(
    lt: LoopThread, sim: EngineProc
) -> None:
    """An exporter without the profiling metric (GPU_UTIL in percent) whose Hostname is not the
    cluster's node name: `dcgm_hostnames` maps it."""
    text = b"\n".join(
        line.replace(b'Hostname="node1"', b'Hostname="gpu-a.example.com"')
        for line in EXPOSITION.split(b"\n")
        if not line.startswith(b"DCGM_FI_PROF_")
    )
    exporter = static_server(lt, {"/dcgm": lambda: Response(text)})
    c = Cluster(lt, sim, [url_of(exporter) + "/dcgm"], dcgm_hostnames={"node1": "gpu-a"})
    try:
        v = wait_for_view(c, sourced)
        fake = now_of(v, "fake-model")
        assert (fake["gpu_utilization"], fake["gpu_utilization_source"]) == (
            round((0.97 + 0.88) / 2, 4), "dcgm")  # fmt: skip
    finally:
        c.close()
        lt.run(exporter.close())


def test_a_dead_exporter_is_skipped_said_once_and_the_figure_falls_back(
    lt: LoopThread, sim: EngineProc, caplog: pytest.LogCaptureFixture
) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    exporter = static_server(lt, {"/metrics": lambda: Response(EXPOSITION)})
    caplog.set_level(logging.WARNING, logger="flexpipe.gateway.ui")
    c = Cluster(lt, sim, [dead, url_of(exporter)])
    try:
        v = wait_for_view(c, sourced)  # the live one is used meanwhile
        assert now_of(v, "fake-model")["gpu_utilization"] == round((NODE1_GPU0 + NODE1_GPU1) / 2, 4)
        gone, live = v["dcgm"]["exporters"]
        assert gone["error"].startswith(f"cannot read the DCGM exporter at {dead}: ")
        assert (gone["num_gpus"], live["num_gpus"], live["error"]) == (0, 3, None)
        # the live exporter goes too: its GPUs are dropped, not kept stale; the figure falls
        # back from the next reading on (the fake engines report no busy time: none; the sim
        # engine's stays modelled). The last minute's figure keeps what was measured in it.
        lt.run(exporter.close())

        def latest(v: dict[str, Any], model: str) -> dict[str, Any]:
            points = [p["models"][model] for p in v["series"] if model in p["models"]]
            return points[-1] if points else {}

        def fell_back(v: dict[str, Any]) -> bool:
            return all(e["error"] for e in v["dcgm"]["exporters"]) and bool(latest(v, "fake-model"))

        v = wait_for_view(c, fell_back)
        v = wait_for_view(c, lambda w: w["series"][-1]["t"] > v["series"][-1]["t"])
        fake = latest(v, "fake-model")
        assert (fake["gpu_utilization"], fake["gpu_utilization_source"]) == (None, None)
        assert latest(v, SIM_MODEL)["gpu_utilization_source"] == "modelled"
        assert {i["gpu_utilization_source"] for i in v["instances"]} == {None}
        assert now_of(v, "fake-model")["gpu_utilization"] == round((NODE1_GPU0 + NODE1_GPU1) / 2, 4)
        said = [r.getMessage() for r in caplog.records if "DCGM exporter" in r.getMessage()]
        assert len(said) == 2 and said[0].startswith(f"cannot read the DCGM exporter at {dead}")
        # the OpenAI API is not touched by any of it
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{c.port}/v1", api_key="x",
                               max_retries=0)  # fmt: skip
        out = client.completions.create(model="fake-model", prompt="hi", max_tokens=4)
        assert out.choices[0].text
    finally:
        c.close()


def test_the_dcgm_settings_are_checked() -> None:
    ctl = {"controller_url": "http://127.0.0.1:8100"}
    with pytest.raises(ConfigError, match="dcgm_urls: 'ftp://x': expected http://HOST:PORT"):
        config_from_dict({**ctl, "dcgm_urls": ["ftp://x"]})
    with pytest.raises(ConfigError, match="dcgm_urls need controller_url"):
        config_from_dict({"dcgm_urls": ["http://gpu-a:9400"]})
    with pytest.raises(ConfigError, match="dcgm_hostnames: expected a mapping"):
        config_from_dict({**ctl, "dcgm_hostnames": {"node1": 3}})
    cfg = config_from_dict({**ctl, "dcgm_urls": ["http://gpu-a:9400"],
                            "dcgm_hostnames": {"node1": "gpu-a"}})  # fmt: skip
    assert (cfg.dcgm_urls, cfg.dcgm_hostnames) == (["http://gpu-a:9400"], {"node1": "gpu-a"})
    assert config_from_dict({}).dcgm_urls == []

"""The dashboard's "Gateway replicas" table in Debian's chromium (as tests/ui/test_ui_browser.py
drives it): a gateway whose controller (a stand-in serving the controller's two read routes,
its topology from the controller's own `topology_doc`) drives two replicas, one up and in sync,
one down; the table shows both rows as the controller said them, and no script error. With one
replica the section stays hidden (the browser test of `flexpipe up` checks the rest)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from selenium import webdriver
from selenium.webdriver.support.ui import WebDriverWait
from test_gateway_fakes import LoopThread
from test_ui_browser import ROOT, browser, console_errors

from flexpipe.cluster import load_cluster
from flexpipe.control.api.ui_api import topology_doc
from flexpipe.gateway.app import Gateway
from flexpipe.gateway.config import config_from_dict
from flexpipe.http.server import App, HttpServer, Request, Response, json_response, serve

__all__ = ["browser"]  # the fixture, used here by name

FLEET = [
    {"url": "http://10.0.0.1:8000", "up": True, "error": None, "seen_s_ago": 0.2,
     "num_in_flight": 7, "requests_per_s": 12.5, "num_instances": 2, "pool": "in sync",
     "num_catch_ups": 0},
    {"url": "http://10.0.0.2:8000", "up": False, "error": "connect: refused",
     "seen_s_ago": 30.0, "num_in_flight": None, "requests_per_s": None,
     "num_instances": None, "pool": "unknown", "num_catch_ups": 1},
]  # fmt: skip

_ROWS = """return Array.from(document.querySelectorAll('#gateways tr[data-gateway]')).map(
  (e) => e.innerText.replace(/\\s+/g, ' ').trim());"""
_HIDDEN = "return document.getElementById('gateways-section').hidden;"


def _controller(lt: LoopThread, fleet: list[dict[str, Any]]) -> HttpServer:
    """The controller's read routes the gateway polls, answering as a controller would."""
    cluster = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
    topology = {**topology_doc(cluster, [], [], 1.0), "gateways": fleet}

    async def topo(req: Request) -> Response:
        return json_response(topology)

    async def shifts(req: Request) -> Response:
        return json_response({"entries": [], "deployment": "fleet"})

    app = App()
    app.add_route("GET", "/admin/topology", topo)
    app.add_route("GET", "/admin/shifts", shifts)
    return lt.run(serve(app, "127.0.0.1", 0))


def _dashboard(lt: LoopThread, fleet: list[dict[str, Any]]) -> Iterator[str]:
    ctl = _controller(lt, fleet)
    gw = Gateway(
        config_from_dict(
            {"backends": [], "controller_url": f"http://127.0.0.1:{ctl.port}",
             "ui_interval_s": 0.2}
        )
    )  # fmt: skip
    server = lt.run(gw.start("127.0.0.1", 0))
    try:
        yield f"http://127.0.0.1:{server.port}/ui"
    finally:
        lt.run(gw.close())
        lt.run(ctl.close())


def test_the_dashboard_lists_the_gateway_replicas_the_controller_drives(
    lt: LoopThread, browser: webdriver.Chrome
) -> None:
    for url in _dashboard(lt, FLEET):
        browser.get(url)
        rows = WebDriverWait(browser, 20).until(lambda d: d.execute_script(_ROWS) or None)
        assert rows == [
            "http://10.0.0.1:8000 up 7 12.50 in sync",
            "http://10.0.0.2:8000 down – – unknown connect: refused",
        ]
        assert browser.execute_script(_HIDDEN) is False
        assert console_errors(browser) == []
    for url in _dashboard(lt, FLEET[:1]):
        browser.get(url)
        WebDriverWait(browser, 20).until(
            lambda d: d.execute_script("return document.querySelector('#gpu-map .node')")
        )
        assert browser.execute_script(_HIDDEN) is True
        assert console_errors(browser) == []

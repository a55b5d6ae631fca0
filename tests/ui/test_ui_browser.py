"""The dashboard in a real headless browser (Debian's chromium and chromedriver, driven by
selenium; nothing is downloaded): `flexpipe up` on the seed's fragmented cluster with sim
engines under streamed load, the page at /ui shows the GPU map without a console error, the
GPU utilisation the sim engines report, the timeline leaves out what another deployment
logged in the same store until asked, a shift made while it is open (another tenant takes
gpu3) appears on the timeline and opens as a whole record, and the same page opens a
simulator report.

`FLEXPIPE_UI_SCREENSHOT=docs/img/dashboard.png` saves the page (after the shift) there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from selenium import webdriver
from selenium.common.exceptions import StaleElementReferenceException
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.support.ui import WebDriverWait
from test_controller import Output
from test_controller_scenarios import SHARED, Load
from test_up import write_models

from flexpipe.launch import free_port
from flexpipe.store import Store
from flexpipe.store.shift_entry import ShiftEntry
from flexpipe.store.shift_log import ShiftLog

ROOT = Path(__file__).resolve().parents[2]
FLEXPIPE = [sys.executable, "-m", "flexpipe"]
CHROMEDRIVER = "/usr/bin/chromedriver"  # Debian's chromium-driver (Makefile installs it)


class UpWithDashboard:
    """`flexpipe up` whose gateway knows its controller (FLEXPIPE_CONTROLLER_URL)."""

    def __init__(self, tmp_path: Path) -> None:
        cluster = tmp_path / "cluster.yaml"
        cluster.write_text((ROOT / "examples/clusters/fragmented-4gpu.yaml").read_text())
        (tmp_path / "shift.yaml").write_text(SHARED)
        self.port = free_port()
        self.controller_url = f"http://127.0.0.1:{free_port()}"
        self.model = f"ui-{os.getpid()}"
        argv = [
            *FLEXPIPE, "up", "--port", str(self.port),
            "--controller-port", self.controller_url.rsplit(":", 1)[1],
            "--time-scale", "0.05", "--tick-s", "0.5", "--drain-timeout-s", "1",
            "--cluster", str(cluster), "--models", str(write_models(tmp_path, self.model)),
            "--store", f"sqlite:///{tmp_path / 'fp.db'}",
            "--shift-config", str(tmp_path / "shift.yaml"),
        ]  # fmt: skip
        env = {**os.environ, "COLUMNS": "200", "PYTHONUNBUFFERED": "1",
               "FLEXPIPE_CONTROLLER_URL": self.controller_url}  # fmt: skip
        self.proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True, env=env)  # fmt: skip
        self.out = Output(self.proc)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


@pytest.fixture
def browser() -> Iterator[webdriver.Chrome]:
    options = webdriver.ChromeOptions()
    options.binary_location = "/usr/bin/chromium"
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--window-size=1400,1700"):  # fmt: skip
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()


def console_errors(driver: webdriver.Chrome) -> list[dict[str, Any]]:
    return [e for e in driver.get_log("browser") if e["level"] in ("SEVERE", "ERROR")]


# Read in one script: the page re-draws parts of itself on every push (every 2 s), so
# element handles found earlier may be gone by the time they are read.
_TILES = """return Array.from(document.querySelectorAll('#gpu-map [data-gpu]')).map(
  (e) => [e.dataset.gpu, e.dataset.instance, e.dataset.state, e.innerText]);"""
_ROWS = """return Array.from(document.querySelectorAll(
  '#shift-list tr.shift[data-kind="' + arguments[0] + '"]')).map((e) => e.innerText);"""
_FIGURE = """return Array.from(document.querySelectorAll('#models .fig')).filter(
  (f) => f.querySelector('.k').innerText === arguments[0]).map(
  (f) => f.querySelector('.v').innerText);"""
_SOURCE = """return Array.from(document.querySelectorAll('#models .fig')).filter(
  (f) => f.querySelector('.k').innerText === arguments[0]).map(
  (f) => f.querySelector('.src') ? f.querySelector('.src').textContent : '');"""
ELSEWHERE = "logged by another deployment on this store"


def gpu_tiles(driver: webdriver.Chrome) -> dict[str, dict[str, str]]:
    rows = driver.execute_script(_TILES)
    return {r[0]: {"instance": r[1], "state": r[2], "text": r[3]} for r in rows}


def shift_rows(driver: webdriver.Chrome, kind: str) -> list[str]:
    return list(driver.execute_script(_ROWS, kind))


def click(driver: webdriver.Chrome, css: str) -> None:
    """A real click, tried again if the element was re-drawn under it."""
    WebDriverWait(driver, 10, ignored_exceptions=(StaleElementReferenceException,)).until(
        lambda d: d.find_element(By.CSS_SELECTOR, css).click() or True
    )


@pytest.mark.timeout(420)
def test_the_dashboard_shows_the_map_and_a_shift_made_while_it_is_open(
    tmp_path: Path, browser: webdriver.Chrome
) -> None:
    with Store(f"sqlite:///{tmp_path / 'fp.db'}") as store:  # the store up will share
        ShiftLog(store, "http://127.0.0.1:1").append(ShiftEntry(
            at=datetime.now(UTC) - timedelta(days=1), kind="plan", reason=ELSEWHERE))  # fmt: skip
    up = UpWithDashboard(tmp_path)
    load: Load | None = None
    try:
        up.out.wait_for("instance(s) serving", 120)
        load = Load(up.port, up.model, num_streams=4, max_tokens=32).start()
        browser.get(f"http://127.0.0.1:{up.port}/ui")
        wait = WebDriverWait(browser, 60, poll_frequency=0.2)
        # the seed's map: four GPUs in three nodes, each of ours serving an instance
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")
        tiles = wait.until(
            lambda d: (t := gpu_tiles(d)) and all(t[g]["instance"] for g in ("gpu1", "gpu2",
                                                                          "gpu3")) and t
        )  # fmt: skip
        assert sorted(tiles) == ["gpu0", "gpu1", "gpu2", "gpu3"]
        assert "A100-80G-SXM" in tiles["gpu1"]["text"] and "L40S" in tiles["gpu3"]["text"]
        assert tiles["gpu1"]["instance"] == tiles["gpu2"]["instance"]  # the TP2 pair
        assert {tiles[g]["state"] for g in ("gpu1", "gpu2", "gpu3")} == {"active"}
        assert "others 40.0" in tiles["gpu1"]["text"]  # tenant-b's half of gpu1
        nodes = [e.get_attribute("data-node") for e in browser.find_elements(
            By.CSS_SELECTOR, "#gpu-map [data-node]")]  # fmt: skip
        assert nodes == ["node0", "node1", "node2"]
        assert "nvlink3 300 GB/s" in browser.find_element(By.ID, "gpu-map").text
        assert up.model in browser.find_element(By.ID, "models").text
        assert shift_rows(browser, "reclaim") == []
        # its engines report their busy time: a utilisation, as `flexpipe status` shows it
        util = wait.until(lambda d: [v for v in d.execute_script(_FIGURE, "GPU util")
                                     if v.endswith("%")])  # fmt: skip
        assert len(util) == 1
        # and says where it came from: the sim engines' model (no DCGM exporter here)
        assert browser.execute_script(_SOURCE, "GPU util") == ["modelled"]
        # the other deployment's entry: left out, counted, shown on request with whose it is
        wait.until(lambda d: d.find_element(By.ID, "shifts-hidden").text == "(1 hidden)")
        assert not [r for r in shift_rows(browser, "plan") if ELSEWHERE in r]
        click(browser, "#shifts-all")
        rows = wait.until(lambda d: [r for r in shift_rows(d, "plan") if ELSEWHERE in r])
        assert "http://127.0.0.1:1" in rows[0] and browser.current_url.endswith("?shifts=all")
        click(browser, "#shifts-all")
        wait.until(lambda d: not [r for r in shift_rows(d, "plan") if ELSEWHERE in r])

        # another tenant takes gpu3 while the page is open
        occupy = subprocess.run(
            [*FLEXPIPE, "cluster", "occupy", "gpu3", "--owner", "batch-job",
             "--controller", up.controller_url],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert occupy.returncode == 0, occupy.stdout + occupy.stderr
        long_wait = WebDriverWait(browser, 150, poll_frequency=0.5)
        rows = long_wait.until(lambda d: [r for r in shift_rows(d, "reclaim") if "succeeded" in r])
        assert "reclaim" in rows[0] and "gpu3" in rows[0]
        tile = long_wait.until(lambda d: (t := gpu_tiles(d)["gpu3"]) and not t["instance"] and t)
        assert "held by batch-job" in tile["text"] and "others 48.0" in tile["text"]
        shot = os.environ.get("FLEXPIPE_UI_SCREENSHOT")
        if shot:
            browser.save_screenshot(shot)

        # the whole record, with the alternatives it beat
        click(browser, '#shift-list tr.shift[data-kind="reclaim"]')
        dialog = wait.until(lambda d: (e := d.find_element(By.ID, "shift-detail")).is_displayed()
                            and e)  # fmt: skip
        assert "Alternatives weighed" in dialog.text and "Phases" in dialog.text
        assert "reclaim" in browser.find_element(By.ID, "detail-title").text
        assert console_errors(browser) == []
    finally:
        if load is not None:
            load.stop()
        up.stop()
    assert load is not None and load.failures() == [], load.failures()[:5]


@pytest.mark.timeout(180)
def test_the_dashboard_opens_a_simulator_report(tmp_path: Path, browser: webdriver.Chrome) -> None:
    report = tmp_path / "report.json"
    sim = subprocess.run([*FLEXPIPE, "sim", "seed-fragmented", "--duration-s", "120", "--json"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert sim.returncode == 0, sim.stderr
    report.write_text(sim.stdout)
    # a gateway with no engine and no controller: the page is all it serves here
    port = free_port()
    argv = [*FLEXPIPE, "gateway", "--port", str(port), "--admin-token", "t"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    out = Output(proc)
    try:
        out.wait_for("flexpipe gateway on", 30)
        browser.get(f"http://127.0.0.1:{port}/ui")
        wait = WebDriverWait(browser, 30, poll_frequency=0.2)
        wait.until(lambda d: d.find_element(By.ID, "status").text == "live")
        browser.find_element(By.ID, "report-file").send_keys(str(report))
        wait.until(lambda d: d.find_element(By.ID, "status").text == "report")
        assert "seed-fragmented" in browser.find_element(By.ID, "source").text
        model = browser.find_element(By.CSS_SELECTOR, '#models [data-model="llama-7b"]')
        assert "TTFT p99 / SLO 2000 ms" in model.text
        paths = model.find_elements(By.CSS_SELECTOR, ".chart svg path")
        assert len(paths) >= 3  # requests/s, TTFT p50, output tokens/s over the run
        assert "llama-7b" in browser.find_element(By.ID, "instances").text
        # the shifts and resource events the report has (none before the simulator drives
        # the controller), each a row of the timeline
        doc = json.loads(sim.stdout)
        num = len(doc.get("shifts", [])) + len(doc.get("resource_events", []))
        rows = browser.execute_script("return document.querySelectorAll('tr.shift').length")
        assert rows == num
        assert console_errors(browser) == []
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)

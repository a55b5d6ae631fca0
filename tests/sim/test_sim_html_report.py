"""The simulator's HTML page prints its numbers as the terminal table (`flexpipe sim`) does:
one formatting function, `sim.report.cell_text`, so no raw float (`3604.350275 s`) reaches
the page."""

from __future__ import annotations

import re
from dataclasses import replace

from flexpipe.sim import load_scenario, report, resolve, simulate
from flexpipe.sim.html_report import report_html
from flexpipe.sim.report import cell_text
from flexpipe.sim.start import StartParams

_RAW_FLOAT = re.compile(r"\d\.\d{4,}")  # more decimals than the tables print


def _text_parts(page: str) -> list[str]:
    """The table cells and paragraphs of the page (the plots' coordinates left out)."""
    return re.findall(r"<td>(.*?)</td>", page) + re.findall(r"<p>(.*?)</p>", page, re.S)


def test_cell_text_is_the_terminal_format() -> None:
    assert cell_text(3604.350275) == "3,604.350"
    assert cell_text(8.188889) == "8.189"
    assert cell_text(12345) == "12,345"
    assert cell_text(None) == "never" and cell_text(None, "-") == "-"
    assert cell_text({"shift": 2, "plan": 1}) == "shift x2, plan x1" and cell_text({}) == "-"


def test_the_html_report_rounds_as_the_terminal_does() -> None:
    # (cold: the engines' load times make the run's end a float with many digits)
    sc = replace(load_scenario(resolve("seed-fragmented")), duration_s=60, start=StartParams())
    rep = report(simulate(sc))
    assert rep["run_end_s"] != round(rep["run_end_s"], 3)  # a float the page must round
    page = report_html(rep)
    parts = _text_parts(page)
    assert parts and not [p for p in parts if _RAW_FLOAT.search(p)]
    intro = re.search(r"<p>(.*?)</p>", page, re.S)
    assert intro is not None and f"ended at\n{cell_text(rep['run_end_s'])} s" in intro.group(1)
    assert f"<td>{cell_text(rep['goodput_requests_per_s'])}</td>" in page
    assert f"<td>{cell_text(rep['shifts_by_kind'])}</td>" in page

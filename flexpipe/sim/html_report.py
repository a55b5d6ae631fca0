"""A run's report as one self-contained HTML page: no script, no stylesheet or font from
anywhere else; the plots are inline SVG drawn here from the report's JSON.

- throughput (output tokens/s) and goodput over time, shifts and resource events marked;
- TTFT and TPOT (p50, p99) over time, same marks;
- the GPU occupancy map: one row per GPU, who holds it when (our instances by model, other
  tenants, lost GPUs);
- the headline numbers, the shifts with their phases and moved requests, the failures.
"""

from __future__ import annotations

import html
from collections.abc import Sequence
from typing import Any

from flexpipe.sim.report import cell_text

__all__ = ["report_html"]

_W, _H, _PAD_L, _PAD_B, _PAD_T = 880, 220, 60, 30, 12
_PALETTE = (
    "#4e79a7",
    "#f28e2b",
    "#59a14f",
    "#e15759",
    "#76b7b2",
    "#edc948",
    "#b07aa1",
    "#ff9da7",
    "#9c755f",
    "#bab0ac",
)
_TENANT, _LOST = "#d0d0d0", "#444444"


def _esc(x: object) -> str:
    return html.escape(str(x), quote=True)


def _fmt(v: float) -> str:
    return f"{v:,.3g}" if abs(v) < 1000 else f"{v:,.0f}"


def _line_plot(
    title: str,
    xs: Sequence[float],
    series: Sequence[tuple[str, Sequence[float | None]]],
    marks: Sequence[tuple[float, str, str]],
    x_max: float,
    unit: str,
) -> str:
    """Lines over time with vertical marks (time, colour, label)."""
    top = max((v for _, ys in series for v in ys if v is not None), default=0.0) or 1.0
    plot_w, plot_h = _W - _PAD_L - 30, _H - _PAD_B - _PAD_T

    def x(t: float) -> float:
        return _PAD_L + plot_w * (t / x_max if x_max else 0.0)

    def y(v: float) -> float:
        return _PAD_T + plot_h * (1 - v / top)

    parts = [
        f'<svg class="plot" width="{_W}" height="{_H}" viewBox="0 0 {_W} {_H}" '
        f'role="img" aria-label="{_esc(title)}">',
        f'<rect x="{_PAD_L}" y="{_PAD_T}" width="{plot_w}" height="{plot_h}" '
        'fill="#fafafa" stroke="#ccc"/>',
    ]
    for k in range(5):
        v = top * k / 4
        parts.append(
            f'<text x="{_PAD_L - 4}" y="{y(v) + 4:.1f}" text-anchor="end" '
            f'font-size="10">{_fmt(v)}</text>'
        )
    for k in range(6):
        t = x_max * k / 5
        parts.append(
            f'<text x="{x(t):.1f}" y="{_H - 12}" text-anchor="middle" '
            f'font-size="10">{t:,.0f} s</text>'
        )
    parts.append(
        f'<text x="12" y="{_PAD_T + plot_h / 2:.0f}" font-size="10" '
        f'transform="rotate(-90 12 {_PAD_T + plot_h / 2:.0f})">{_esc(unit)}</text>'
    )
    for t, colour, label in marks:
        parts.append(
            f'<line class="mark" x1="{x(t):.1f}" x2="{x(t):.1f}" y1="{_PAD_T}" '
            f'y2="{_PAD_T + plot_h}" stroke="{colour}" stroke-dasharray="4 3">'
            f"<title>{_esc(label)}</title></line>"
        )
    for i, (name, ys) in enumerate(series):
        colour = _PALETTE[i % len(_PALETTE)]
        # one polyline per run of values: an interval with none (no request completed in
        # it: no latency) is a gap, not a drop to 0
        runs: list[list[str]] = [[]]
        for t, value in zip(xs, ys, strict=True):
            if value is None:
                runs.append([])
            else:
                runs[-1].append(f"{x(t):.1f},{y(value):.1f}")
        for pts in (" ".join(r) for r in runs if r):
            parts.append(
                f'<polyline fill="none" stroke="{colour}" stroke-width="1.8" '
                f'points="{pts}"><title>{_esc(name)}</title></polyline>'
            )
        parts.append(
            f'<text x="{_PAD_L + 8 + 150 * i}" y="{_PAD_T + 12}" font-size="11" '
            f'fill="{colour}">{_esc(name)}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _occupancy_map(rows: Sequence[dict[str, Any]], x_max: float, models: Sequence[str]) -> str:
    row_h = 14 if len(rows) <= 64 else max(1, 900 // len(rows))
    label_w = 120 if row_h >= 10 else 10
    plot_w = _W - label_w - 30
    h = row_h * len(rows) + 40
    colours = {m: _PALETTE[i % len(_PALETTE)] for i, m in enumerate(models)}
    parts = [
        f'<svg class="occupancy" width="{_W}" height="{h}" viewBox="0 0 {_W} {h}" '
        'role="img" aria-label="GPU occupancy">'
    ]

    def x(t: float) -> float:
        return label_w + plot_w * (t / x_max if x_max else 0.0)

    for i, row in enumerate(rows):
        top = i * row_h
        if row_h >= 10:
            name = f"{_esc(row['gpu'])} {_esc(row['type'])}"
            parts.append(
                f'<text x="{label_w - 4}" y="{top + row_h - 3}" text-anchor="end" '
                f'font-size="10">{name}</text>'
            )
        for seg in row["segments"]:
            holder = seg["holder"]
            if holder == "lost":
                colour = _LOST
            elif holder.startswith("tenant:"):
                colour = _TENANT
            else:
                colour = colours.get(seg.get("model", ""), _PALETTE[0])
            x0, x1 = x(seg["start_s"]), x(seg["end_s"])
            parts.append(
                f'<rect x="{x0:.1f}" y="{top}" width="{max(0.5, x1 - x0):.1f}" '
                f'height="{max(1, row_h - 1)}" fill="{colour}" fill-opacity="0.85">'
                f"<title>{_esc(row['gpu'])}: {_esc(holder)} {seg['start_s']:.0f}-"
                f"{seg['end_s']:.0f} s</title></rect>"
            )
    y0 = row_h * len(rows) + 14
    legend = [*((m, c) for m, c in colours.items()), ("other tenant", _TENANT), ("lost", _LOST)]
    for i, (name, colour) in enumerate(legend):
        parts.append(
            f'<rect x="{label_w + 130 * i}" y="{y0}" width="10" height="10" '
            f'fill="{colour}"/><text x="{label_w + 14 + 130 * i}" y="{y0 + 9}" '
            f'font-size="10">{_esc(name)}</text>'
        )
    parts.append(
        f'<text x="{label_w}" y="{y0 + 24}" font-size="10">0 s</text>'
        f'<text x="{_W - 10}" y="{y0 + 24}" font-size="10" text-anchor="end">'
        f"{x_max:,.0f} s</text></svg>"
    )
    return "".join(parts)


def _table(head: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    th = "".join(f"<th>{_esc(h)}</th>" for h in head)
    body = "".join(
        "<tr>" + "".join(f"<td>{_esc(cell_text(c, '–'))}</td>" for c in r) + "</tr>" for r in rows
    )
    return f"<table><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table>"


def report_html(rep: dict[str, Any]) -> str:
    """The page for one report (`report.report(result)`)."""
    tl = rep["timeline"]
    xs = [row["start_s"] for row in tl]
    x_max = float(rep.get("run_end_s", rep["duration_s"]))  # the drain after the arrivals too
    marks = [
        (float(s["at_s"]), "#e15759", f"shift ({s['trigger']}) at {s['at_s']:.0f} s")
        for s in rep["shifts"]
        if s["trigger"] != "plan"
    ]
    marks += [
        (float(e["at_s"]), "#888888", f"{e['what']} at {e['at_s']:.0f} s")
        for e in rep["resource_timeline"]
    ]
    throughput = _line_plot(
        "throughput over time",
        xs,
        [("output tokens/s", [r["tokens_per_s"] for r in tl])],
        marks,
        x_max,
        "tokens/s",
    )
    goodput = _line_plot(
        "goodput over time",
        xs,
        [
            ("goodput req/s", [r["goodput_requests_per_s"] for r in tl]),
            ("GPUs reserved", [r["gpus_reserved"] for r in tl]),
        ],
        marks,
        x_max,
        "req/s, GPUs",
    )
    latency = _line_plot(
        "latency over time",
        xs,
        [
            ("TTFT p50", [r["ttft_p50_s"] for r in tl]),
            ("TTFT p99", [r["ttft_p99_s"] for r in tl]),
            ("TPOT p50", [r["tpot_p50_s"] for r in tl]),
            ("TPOT p99", [r["tpot_p99_s"] for r in tl]),
        ],
        marks,
        x_max,
        "seconds",
    )
    occ = _occupancy_map(rep["gpu_occupancy"], x_max, list(rep["models"]))
    res = rep["reservation"]
    first = rep["first_served_s"]
    head = [
        ("requests", rep["num_requests"]),
        ("completed", rep["num_completed"]),
        ("failed", rep["num_failed"]),
        ("goodput (req/s)", rep["goodput_requests_per_s"]),
        ("SLO attainment", rep["slo_attainment"]),
        ("first served (s)", "never" if first is None else first),
        ("GPU-hours reserved", rep["gpu_hours_reserved"]),
        ("GPU-hours used", rep["gpu_hours_used"]),
        ("utilisation", rep["utilisation"]),
        ("reservation / peak provisioning", res["share_of_peak"]),
        ("shifts by kind", rep["shifts_by_kind"]),
        ("requests migrated by method", rep["requests_migrated_by_method"]),
    ]
    models = [
        (
            name,
            m["num_requests"],
            m["num_failed"],
            m["goodput_requests_per_s"],
            m["throughput_tokens_per_s"],
            m["ttft_s"]["p50"],
            m["ttft_s"]["p99"],
            m["tpot_s"]["p50"],
            m["tpot_s"]["p99"],
            m["e2e_s"]["p50"],
            m["e2e_s"]["p99"],
        )
        for name, m in rep["models"].items()
    ]
    shifts = [
        (
            f"{s['at_s']:.1f}",
            s["trigger"],
            "yes"
            if s["succeeded"]
            else f"{'refused' if s['refused'] else 'no'}: {s['why_failed']}",
            ", ".join(f"{k} {v:.1f}s" for k, v in s["phases_s"].items()),
            ", ".join(f"{k} {v}" for k, v in s["migrated"].items()) or "-",
            s["reason"],
        )
        for s in rep["shifts"]
    ]
    phases = [
        (
            p["start_s"],
            p["end_s"],
            p["after"],
            p["completed"],
            p["tokens_per_s"],
            p["goodput_requests_per_s"],
        )
        for p in rep["phases"]
    ]
    failures = [(why, n) for why, n in rep["failed_by_why"].items()]
    title = f"flexpipe sim: {rep['scenario']} / {rep['policy']} (seed {rep['seed']})"
    return f"""<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>{_esc(title)}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 24px; color: #222; }}
table {{ border-collapse: collapse; margin: 8px 0 20px; font-size: 13px; }}
td, th {{ border: 1px solid #ddd; padding: 3px 8px; text-align: left; vertical-align: top; }}
th {{ background: #f3f3f3; }}
h2 {{ margin-top: 28px; font-size: 17px; }}
</style></head><body>
<h1>{_esc(title)}</h1>
<p>{_esc(cell_text(rep["duration_s"]))} s of arrivals simulated, the last request ended at
{_esc(cell_text(rep.get("run_end_s", rep["duration_s"])))} s; routing {_esc(rep["routing"])};
dashed lines: red = shifts, grey = resource timeline events.</p>
{_table(["", "value"], head)}
<h2>Throughput over time</h2>
{throughput}
<h2>Goodput and GPUs reserved over time</h2>
{goodput}
<h2>Latency over time</h2>
{latency}
<h2>GPU occupancy</h2>
{occ}
<h2>Models</h2>
{
        _table(
            [
                "model",
                "requests",
                "failed",
                "goodput req/s",
                "tokens/s",
                "TTFT p50",
                "TTFT p99",
                "TPOT p50",
                "TPOT p99",
                "e2e p50",
                "e2e p99",
            ],
            models,
        )
    }
<h2>Throughput per phase</h2>
{_table(["from s", "to s", "after", "completed", "tokens/s", "goodput req/s"], phases)}
<h2>Shifts</h2>
{_table(["at s", "trigger", "succeeded", "phases", "moved requests", "why"], shifts)}
<h2>Failed requests</h2>
{_table(["why", "requests"], failures) if failures else "<p>none</p>"}
</body></html>
"""

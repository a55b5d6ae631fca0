"""Pure drawing of a `Snapshot` with rich: the tables of `flexpipe status` and the screen of
`flexpipe top`. No I/O; the same snapshot always draws the same text (tests compare it)."""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime

from rich.console import Group, RenderableType
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from flexpipe.hardware import GiB
from flexpipe.observe.status_snapshot import Snapshot

__all__ = [
    "STATE_STYLE",
    "gateways_table",
    "gpus_table",
    "header",
    "instances_table",
    "models_table",
    "status_view",
    "top_view",
]

STATE_STYLE = {
    "starting": "yellow",
    "rehearsing": "cyan",
    "active": "green",
    "draining": "magenta",
    "gone": "dim",
}
_HEALTH_STYLE = {"ok": "green", "ejected": "red", "unreachable": "red"}
NONE = "—"
# measured, but no DCGM exporter reports its GPUs and its engines report no busy time (vLLM
# does not): the dashboard says the same
NOT_REPORTED = "n/a"
_NOT_REPORTED_WHY = (
    "GPU util n/a: no DCGM exporter reports its GPUs and its engines report no busy time "
    "(vLLM does not; docs/observability.md)"
)
# where a model's GPU utilisation came from (`gpu_utilization_source`), under the table
SOURCE_WORDS = {
    "dcgm": "measured on its GPUs by DCGM",
    "modelled": "its sim engines' modelled busy time",
}


def _pct(x: float | None) -> str:
    return NONE if x is None else f"{x * 100:.0f}%"


def _ms(x: float | None) -> str:
    return NONE if x is None else f"{x * 1e3:,.0f}"


def _num(x: float | None, fmt: str = ".1f") -> str:
    return NONE if x is None else format(x, fmt)


def _against(value_s: float | None, slo_s: float | None) -> Text:
    """`p95 / SLO` in ms, red when the p95 is over the (p99) SLO."""
    text = f"{_ms(value_s)} / {_ms(slo_s)}"
    over = value_s is not None and slo_s is not None and value_s > slo_s
    return Text(text, style="bold red" if over else "")


def _table(title: str, columns: Sequence[str], right: Sequence[str] = ()) -> Table:
    table = Table(title=title, title_justify="left", expand=False)
    for col in columns:
        table.add_column(col, justify="right" if col in right else "left", no_wrap=True)
    return table


def header(snap: Snapshot) -> Text:
    at = datetime.fromtimestamp(snap.at_s, UTC)
    window = "since start" if snap.window_s is None else f"last {snap.window_s:.0f} s"
    models = "none yet"
    if snap.gateway_window_s is not None:
        models = f"the gateway's last {snap.gateway_window_s:.0f} s, as the dashboard"
    gateway = snap.gateway_url or NONE
    text = Text()
    text.append("flexpipe", style="bold")
    text.append(f" · cluster {snap.cluster} · engine {snap.engine} · {at:%H:%M:%S} UTC")
    text.append(f" · models: {models} · instances: {window}\n")
    text.append(f"controller {snap.controller_url} · gateway {gateway} ")
    text.append(
        "up" if snap.gateway_up else "NOT ANSWERING",
        style="green" if snap.gateway_up else "bold red",
    )
    if len(snap.gateways) > 1:  # (the queue and the models' figures: the first that answers)
        num_up = sum(g.up for g in snap.gateways)
        text.append(
            f" · replicas {num_up}/{len(snap.gateways)} up",
            style="" if num_up == len(snap.gateways) else "bold red",
        )
    text.append(f" · gateway queue {snap.num_gateway_queued} · shifts {snap.num_shifts}")
    if snap.time_scale != 1.0:
        text.append(f"\ntime scale {snap.time_scale:g}: latencies and rates in modelled seconds")
    return text


def models_table(snap: Snapshot) -> Table:
    right = (
        "inst",
        "req/s",
        "err",
        "TTFT p95/SLO ms",
        "TPOT p95/SLO ms",
        "queue",
        "prefix hit",
        "GPU util",
        "tok/s",
    )
    table = _table("models", ("model", *right), right)
    for m in snap.models:
        name = Text(m.name)
        if m.refused is not None:  # no GPU free to us can place it: its requests get a 503
            name.append(" (refused)", style="red")
        table.add_row(
            name,
            str(m.num_instances),
            _num(m.request_rate_per_s, ".2f"),
            _pct(m.error_rate),
            _against(m.ttft_p95_s, m.ttft_slo_s),
            _against(m.tpot_p95_s, m.tpot_slo_s),
            _num(m.num_queued, "d"),
            _pct(m.prefix_hit_rate),
            NOT_REPORTED if m.measured and m.gpu_utilization is None else _pct(m.gpu_utilization),
            _num(m.generation_tokens_per_s, ",.0f"),
        )
    notes = [f"{m.name} refused: {m.refused}" for m in snap.models if m.refused is not None]
    for source, words in SOURCE_WORDS.items():
        names = [m.name for m in snap.models if m.gpu_utilization_source == source]
        if names:
            notes.append(f"GPU util of {', '.join(names)}: {words}")
    if any(m.measured and m.gpu_utilization is None for m in snap.models):
        notes.append(_NOT_REPORTED_WHY)
    if notes:  # the reasons are long: under the table, not in a cell
        table.caption = "\n".join(notes)
        table.caption_justify = "left"
    return table


def instances_table(snap: Snapshot) -> Table:
    right = ("running", "waiting", "in flight", "KV", "prefix hit", "GPU util")
    table = _table(
        "instances", ("instance", "model", "gear", "GPUs", "state", "health", *right), right
    )
    for i in snap.instances:
        running = NONE if i.num_running is None else str(i.num_running)
        if i.num_running is not None and i.max_num_seqs is not None:
            running = f"{i.num_running}/{i.max_num_seqs}"
        table.add_row(
            i.name,
            i.model,
            i.gear,
            "+".join(i.gpus),
            Text(i.state, style=STATE_STYLE.get(i.state, "")),
            Text(i.health, style=_HEALTH_STYLE.get(i.health, "yellow")),
            running,
            _num(i.num_waiting, "d"),
            _num(i.num_in_flight, "d"),
            _pct(i.kv_usage),
            _pct(i.prefix_hit_rate),
            _pct(i.gpu_utilization),
        )
    return table


def gpus_table(snap: Snapshot) -> Table:
    table = _table(
        "GPUs",
        ("GPU", "node", "type", "memory GiB", "others' GiB", "instance", "gear", "state"),
        ("memory GiB",),
    )
    for g in snap.gpus:
        others = f"{g.used_by_others_bytes / GiB:.0f}"
        who = g.occupied_by or g.owner
        if who and g.used_by_others_bytes > 0:
            others += f" ({who})"
        table.add_row(
            g.id,
            g.node,
            g.type,
            f"{g.capacity_bytes / GiB:.0f}",
            others,
            g.instance or NONE,
            g.gear or NONE,
            Text(g.state or "unused", style=STATE_STYLE.get(g.state or "", "dim")),
        )
        for name, gear, state in g.shared_with:  # a row each, under the GPU's
            table.add_row(
                "", "", "", "", "", name, gear, Text(state, style=STATE_STYLE.get(state, ""))
            )
    return table


def gateways_table(snap: Snapshot) -> Table:
    """The gateway replicas the controller drives: up, load, and whether each one's pool is
    the controller's (a replica that was away is caught up: docs/controller.md)."""
    right = ("in flight", "req/s", "seen")
    table = _table("gateways", ("gateway", "up", *right, "pool"), right)
    for g in snap.gateways:
        pool_style = "green" if g.pool == "in sync" else "yellow"
        table.add_row(
            g.url,
            Text("up", style="green") if g.up else Text("DOWN", style="bold red"),
            _num(g.num_in_flight, "d"),
            _num(g.requests_per_s, ".2f"),
            NONE if g.seen_s_ago is None else f"{g.seen_s_ago:.0f} s ago",
            Text(g.pool, style=pool_style),
        )
    errors = [f"{g.url}: {g.error}" for g in snap.gateways if not g.up and g.error]
    if errors:
        table.caption = "\n".join(errors)
        table.caption_justify = "left"
    return table


def _fleet(snap: Snapshot) -> list[RenderableType]:
    """The gateways' table where the controller drives several."""
    return [gateways_table(snap)] if len(snap.gateways) > 1 else []


def _decision(snap: Snapshot) -> Text:
    text = Text()
    text.append("last decision: ", style="bold")
    text.append(snap.last_decision or NONE)
    if snap.last_outcome:
        text.append("\nlast shift: ", style="bold")
        text.append(snap.last_outcome)
    return text


def status_view(snap: Snapshot) -> Group:
    """`flexpipe status`: the header, models, instances, GPUs and the last decision."""
    return Group(
        header(snap),
        *_fleet(snap),
        models_table(snap),
        instances_table(snap),
        gpus_table(snap),
        _decision(snap),
    )


def top_view(snap: Snapshot, shifts: RenderableType | None = None, note: str = "") -> Group:
    """`flexpipe top`: the same numbers in panels, with the shift log's last entries."""
    parts: list[RenderableType] = [
        Panel(header(snap), title="flexpipe top", subtitle=note or "q or Ctrl-C quits"),
        *_fleet(snap),
        models_table(snap),
        instances_table(snap),
        gpus_table(snap),
        _decision(snap),
    ]
    if shifts is not None:
        parts.append(shifts)
    return Group(*parts)

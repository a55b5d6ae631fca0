"""The admin API's questions that span every gateway worker or replica (shared_state.py
`ask_peers`): an instance drained everywhere, the requests it serves anywhere, a move carried
out by the member that holds the request, the wait queue's demand on any member, and the
metrics of all of them as one exposition (what the controller's signals read).

`answer` is what a member answers another's question with; the admin API merges its own
answer with the others' (admin.py)."""

from __future__ import annotations

import math
import re
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway

__all__ = ["MAX_GAUGES", "SUMMED_FIELDS", "answer", "merge_expositions", "merge_instances"]

# gauges where each member says the same thing (merged by max, not summed)
MAX_GAUGES = frozenset({"flexpipe_instance_up"})
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{.*\})? (\S+)$")


async def answer(gw: Gateway, kind: str, body: dict[str, Any]) -> Any:
    """This member's answer to another's question."""
    from flexpipe.gateway.admin import parse_move

    if kind == "drained":
        return await gw.drained(str(body["url"]), float(body["wait_s"]))
    if kind == "requests":
        return [c.describe() for c in gw.calls_on(str(body["url"]))]
    if kind == "move":  # only the requests held here: the asker runs the rest
        mine = [parse_move(m, i) for i, m in enumerate(body["moves"]) if gw.call(m.get("id"))]
        results = []
        for call_id, move in mine:
            outcome, warm = await gw.move_request(call_id, move)
            results.append([call_id, outcome, warm])
        return results
    if kind == "demand":
        return await gw.demand(list(body["models"]), float(body["wait_s"]))
    if kind == "metrics":
        return gw.own_metrics().decode()
    if kind == "instances":
        return [i.as_dict() for i in gw.pool.instances.values()]
    raise ValueError(f"unknown question {kind!r}")


SUMMED_FIELDS = ("num_in_flight", "max_concurrency")  # each member's part of the instance


def merge_instances(
    mine: list[dict[str, Any]], theirs: Iterable[list[dict[str, Any]] | None]
) -> list[dict[str, Any]]:
    """The instances as this member lists them, with what each member holds of them summed
    (its requests in flight, its share of the slots): the whole gateway's view."""
    by_url = {i["url"]: dict(i) for i in mine}
    for listing in theirs:
        for other in listing or []:
            inst = by_url.get(other.get("url"))
            if inst is not None:
                for key in SUMMED_FIELDS:
                    inst[key] = int(inst[key]) + int(other.get(key, 0))
    return list(by_url.values())


def merge_expositions(texts: Iterable[str]) -> bytes:
    """Prometheus text expositions of several members as one: each sample summed over the
    members (counters, histograms, queue and in-flight gauges), the `MAX_GAUGES` by max; a
    family's comments and samples kept together (the format requires it), families and
    samples in the order they first appear."""
    families: dict[str, tuple[list[str], dict[str, float]]] = {}  # name -> (comments, samples)
    for text in texts:
        family = ""
        for line in text.splitlines():
            if line.startswith("#"):
                parts = line.split(" ", 3)
                if len(parts) >= 3 and parts[1] in ("HELP", "TYPE"):
                    family = parts[2]
                comments = families.setdefault(family, ([], {}))[0]
                if line not in comments:
                    comments.append(line)
                continue
            m = _SAMPLE.match(line)
            if m is None:
                continue
            samples = families.setdefault(family, ([], {}))[1]
            key = f"{m.group(1)}{m.group(2) or ''}"
            value = float(m.group(3))
            if key not in samples:
                samples[key] = value
            elif m.group(1) in MAX_GAUGES:
                samples[key] = max(samples[key], value)
            else:
                samples[key] += value
    out = []
    for comments, samples in families.values():
        out += comments
        out += [f"{key} {_num(value)}" for key, value in samples.items()]
    return ("\n".join(out) + "\n").encode()


def _num(value: float) -> str:
    if not math.isfinite(value) or value != int(value) or abs(value) > 1e15:
        return repr(value)
    return f"{value:.1f}"

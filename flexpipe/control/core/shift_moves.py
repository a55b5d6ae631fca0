"""Which requests a shift moves off its leaving instances, where, how and when (pure): the
shift procedure's move planning (`shift_procedure.py`), from what its driver surveys.

Per model, the requests on the leaving instances go to the active instances of the model that
stay, all planned together by `plan_moves` (where each pauses least, the wait for a free slot
there counted; its KV over the link or recomputed; and when, so that no move waits paused
behind another on the same destination or link); moves planned within 10 ms of each other go
out together, in one wave.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Generator, Mapping, Sequence
from typing import Any

from flexpipe.control.core.move_inputs import (
    context_tokens,
    decode_interval_s,
    destination_of,
    tokens_left,
    warm_timeout_s,
)
from flexpipe.control.core.shift_commands import (
    Command,
    Continue,
    MoveOrder,
    Record,
    Reply,
    Survey,
    Surveyed,
    Wave,
)
from flexpipe.model_spec import ModelSpec
from flexpipe.policies.shift.migration import MoveRequest, outlives, plan_moves

__all__ = ["plan_waves", "waves_of"]

Do = Callable[[Command], Generator[Command, Reply, Any]]  # a command, its result


def waves_of(orders: Sequence[tuple[float, MoveOrder]], time_scale: float) -> tuple[Wave, ...]:
    """Moves planned (at modelled seconds from now) within 10 ms of each other go together;
    each wave at its time in driver seconds."""
    waves: dict[float, list[MoveOrder]] = {}
    for at_s, order in orders:
        waves.setdefault(round(at_s, 2), []).append(order)
    return tuple(Wave(at_s * time_scale, tuple(w)) for at_s, w in sorted(waves.items()))


def plan_waves(
    do: Do,
    running: Mapping[str, Any],
    sources: Sequence[Any],
    leaving: Sequence[Any],
    outliving_s: float | None,
    time_scale: float,
    warm_moves: bool,
    specs: Mapping[str, ModelSpec],
    kv_moves: bool = True,
) -> Generator[Command, Reply, tuple[tuple[Wave, ...], int, tuple[str, ...]]]:
    """The waves that move what runs on `sources` (with `outliving_s`, modelled seconds:
    only what would still run that long from now) to the active instances of `running` that
    do not leave. `warm_moves`: the gateway pre-copies recomputes (priced so, and bounded).
    `kv_moves` False: the engines cannot hand KV over, so every move recomputes.
    Returns the waves, how many requests had nowhere to go at the deadline (the gateway
    continues them when their instance stops) and the outcomes of those it moved at once."""
    gone = {i.key for i in leaving}
    horizon_s = math.inf if outliving_s is None else outliving_s
    orders: list[tuple[float, MoveOrder]] = []
    num_stuck = 0
    continued: list[str] = []
    for model in sorted({i.planned.model for i in sources}):
        mine = tuple(i for i in sources if i.planned.model == model)
        candidates = tuple(
            i for k, i in running.items() if i.planned.model == model and k not in gone
        )
        survey: Surveyed = yield from do(Survey(mine, candidates))
        cluster = survey.cluster
        reqs: list[MoveRequest] = []
        where: dict[int, tuple[Any, Record]] = {}  # request id -> (source, request)
        for src, src_reqs in zip(mine, survey.requests, strict=True):
            spec = specs.get(src.planned.model_id)
            interval_s = decode_interval_s(cluster, src.planned, src_reqs, spec)
            if outliving_s is not None:
                src_reqs = tuple(
                    r for r in src_reqs if outlives(tokens_left(r), interval_s, outliving_s)
                )
            for r in src_reqs:
                reqs.append(MoveRequest(int(r["id"]), context_tokens(r), src.url, interval_s))
                where[int(r["id"])] = (src, r)
        if not survey.destinations:
            if outliving_s is None and where:
                num_stuck += len(where)
                continued += yield from do(Continue(tuple(where.values())))
            continue
        urls = [(s.url, s.planned) for s in sources]
        destinations = [
            destination_of(
                cluster, urls, d.url, d.planned, d_reqs, specs.get(d.planned.model_id), kv_moves
            )
            for d, d_reqs in survey.destinations
        ]
        by_url = {d.url: d for d, _ in survey.destinations}
        for m in plan_moves(reqs, destinations, horizon_s, warm=warm_moves):
            timeout_s = 0.0
            if m.choice.method == "recompute":  # the gateway's pre-copy: bounded
                timeout_s = warm_timeout_s(m.choice.done_s, time_scale, warm_moves)
            order = MoveOrder(
                m.id,
                m.choice.method,
                where[m.id][0],
                by_url[m.destination],
                m.choice.pause_s,
                timeout_s,
            )
            orders.append((m.at_s, order))
    return waves_of(orders, time_scale), num_stuck, tuple(continued)

"""The executor's moves off a draining instance (the migration step), with a fake gateway at
the I/O seam: each request lands where it pauses least — an instance with a free slot, not
a full one —, only what would outlive the drain deadline moves before it, and every batch
of moves is reported with the stream ids the clients see."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import yaml

from flexpipe.cluster import load_cluster
from flexpipe.control.core.move_inputs import decode_interval_s
from flexpipe.control.core.shift_outcome import ShiftOutcome
from flexpipe.control.core.shift_procedure import ShiftParams, ShiftProcedure
from flexpipe.control.executor import Executor, LiveInstance, _LiveShift
from flexpipe.policies.planner import parse_models, plan
from flexpipe.policies.shift.migration import perf_model_of, warmed_recompute_s
from flexpipe.policies.shift.snapshot import instance_key

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")


class FakeGateway:
    """What the gateway's admin API answers: the requests on each instance; moves recorded."""

    def __init__(self, requests: dict[str, list[dict[str, Any]]]) -> None:
        self.requests = requests
        self.moves: list[dict[str, Any]] = []

    async def requests_on(self, url: str) -> list[dict[str, Any]]:
        return list(self.requests.get(url, []))

    async def move(self, moves: list[dict[str, Any]]) -> list[dict[str, Any]]:
        self.moves += moves
        return [{"id": m["id"], "outcome": m["method"], "warmed": m["method"] == "recompute",
                 "warm": "warmed" if m["method"] == "recompute" else None}
                for m in moves]  # fmt: skip


def req(call_id: int, output: int, max_tokens: int, prompt: int = 1000) -> dict[str, Any]:
    return {"id": call_id, "num_prompt_tokens": prompt, "num_output_tokens": output,
            "max_tokens": max_tokens, "request_id": f"r{call_id}"}  # fmt: skip


async def move_off(
    ex: Executor,
    sources: list[LiveInstance],
    running: dict[str, LiveInstance],
    leaving: list[LiveInstance],
    out: ShiftOutcome,
    outliving_s: float | None = None,
) -> int:
    """A retire's moves off `sources`: planned by the shift procedure, carried out by the
    executor (before the deadline: as the drain's early waves). Returns how many requests
    moved, or had nowhere to go at the deadline."""
    params = ShiftParams(time_scale=ex.time_scale, warm_moves=ex.warm_moves)
    procedure = ShiftProcedure(running, [], params)
    procedure.out = out
    live = _LiveShift(ex, CLUSTER, running)
    waves, num_stuck = await live.drive(procedure._plan_moves(sources, leaving, outliving_s))
    if outliving_s is not None:
        return procedure._count(await live._early_waves(waves, asyncio.Event()))
    for wave in waves:
        num_stuck += procedure._count(await live._move_wave(wave, "at the deadline"))
    return int(num_stuck)


def setup(requests: dict[str, list[dict[str, Any]]], warm_moves: bool = True) -> tuple[Any, ...]:
    running: dict[str, LiveInstance] = {}
    for p in plan(CLUSTER, [DEMAND]).instances:
        inst = LiveInstance(p, SimpleNamespace(endpoint=f"http://{'+'.join(p.gpu_ids)}"))  # type: ignore[arg-type]
        inst.state = "active"
        running[instance_key(p)] = inst
    by_gpus = {"+".join(sorted(i.planned.gpu_ids)): i for i in running.values()}
    source, l40s, l4 = by_gpus["gpu1+gpu2"], by_gpus["gpu3"], by_gpus["gpu0"]
    source.state = "draining"
    gateway = FakeGateway({{"source": source, "l40s": l40s, "l4": l4}[k].url: v
                           for k, v in requests.items()})  # fmt: skip
    lines: list[str] = []
    ex = Executor(None, gateway, lambda p: None, on_moves=lines.append,  # type: ignore[arg-type]
                  warm_moves=warm_moves)  # fmt: skip
    return ex, gateway, running, source, l40s, l4, lines


def test_moves_land_on_the_instance_with_free_slots_not_the_full_one() -> None:
    l4_slots = 8  # at least the plan's L4 gear holds
    ex, gw, running, source, l40s, l4, lines = setup({
        "source": [req(1, 10, 2000, prompt=900), req(2, 20, 2000, prompt=1900)],
        "l4": [req(10 + n, 5, 2000) for n in range(l4_slots)],  # every slot, long to go
        "l40s": [req(20, 1, 64)],  # one of its many slots taken
    })  # fmt: skip
    out = ShiftOutcome(succeeded=True)
    num = asyncio.run(move_off(ex, [source], running, [source], out))
    assert l4.planned.gear.max_num_seqs <= l4_slots and l40s.planned.gear.max_num_seqs > 2
    assert num == 2
    assert sorted((m["id"], m["target"]) for m in gw.moves) == [(1, l40s.url), (2, l40s.url)]
    assert sum(out.migrated.values()) == 2
    # the link to the L40S is slow: two recomputes there, pre-copied, one after the other;
    # each request's priced pause, method, warm-up and destination in the line
    said = (f"controller: moved 1 request(s) off {source.url} at the deadline (recompute 1, "
            "warmed 1)")  # fmt: skip
    assert len(lines) == 2 and all(line.startswith(said) for line in lines)
    assert re.search(rf": r1=\d+ms:recompute:warmed@{re.escape(l40s.url)}$", lines[0])
    assert re.search(rf": r2=\d+ms:recompute:warmed@{re.escape(l40s.url)}$", lines[1])


def test_before_the_deadline_only_what_would_outlive_it_moves() -> None:
    ex, gw, running, source, _, _, lines = setup({
        "source": [req(1, 10, 2000), req(2, 60, 64), req(3, 0, 64)],
    })  # fmt: skip
    out = ShiftOutcome(succeeded=True)
    num = asyncio.run(move_off(ex, [source], running, [source], out, outliving_s=4.0))
    assert num == 1 and [m["id"] for m in gw.moves] == [1]  # 1,990 tokens left: ~100 s
    assert "before the drain deadline" in lines[0]
    # nowhere to go: nothing moves early, and all of it counts as still running at the end
    running_alone = {k: i for k, i in running.items() if i is source}
    assert asyncio.run(move_off(ex, [source], running_alone, [source], out, 4.0)) == 0
    assert asyncio.run(move_off(ex, [source], running_alone, [source], out)) == 3


def test_and_the_other_way_round_when_the_big_instance_is_full() -> None:
    ex, gw, running, source, l40s, l4, _ = setup({
        "source": [req(1, 10, 2000, prompt=900)],
        "l40s": [req(10 + n, 5, 2000) for n in range(64)],  # every slot, long to go
    })  # fmt: skip
    assert l40s.planned.gear.max_num_seqs <= 64
    out = ShiftOutcome(succeeded=True)
    assert asyncio.run(move_off(ex, [source], running, [source], out)) == 1
    assert [m["target"] for m in gw.moves] == [l4.url]


def test_a_warmed_move_is_priced_at_its_cut_over_and_its_warm_up_bounded_by_both() -> None:
    requests = {"source": [req(1, 10, 2000, prompt=1900)]}
    moved = {}
    for warm in (True, False):
        ex, gw, running, source, l40s, _, lines = setup(requests, warm_moves=warm)
        asyncio.run(move_off(ex, [source], running, [source], ShiftOutcome(True)))
        ((m,),) = [gw.moves]
        priced_ms = int(re.search(r": r1=(\d+)ms", lines[0])[1])  # type: ignore[index]
        moved[warm] = (m, priced_ms)
    (warm_move, warm_ms), (cold_move, cold_ms) = moved[True], moved[False]
    assert warm_move["method"] == cold_move["method"] == "recompute"
    assert cold_move["warm_timeout_s"] == 0.0  # no pre-copy asked for
    # the pre-copy's bound: twice the warm-up and the cut-over (>= the cold pause, in wall s)
    assert warm_move["warm_timeout_s"] >= 2 * cold_ms / 1e3
    # priced as the policy prices it: the L40S's step (empty), the 1,910-token context
    # warmed while the request generates on the source at its interval there
    step_s = decode_interval_s(CLUSTER, l40s.planned, [])
    interval_s = decode_interval_s(CLUSTER, source.planned, requests["source"])
    pm = perf_model_of(CLUSTER, l40s.planned)
    assert cold_ms == round(pm.prefill_s(1910) * 1e3)
    assert warm_ms == round(warmed_recompute_s(pm, 1910, step_s, interval_s)[1] * 1e3)
    assert warm_ms < cold_ms / 2

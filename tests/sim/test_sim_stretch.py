"""Closed-form decode stretches against stepping one engine iteration per event.

The simulator's speed comes from advancing an unchanged decode batch many steps in one event
(flexpipe.sim.stretch). These tests run the same scenarios both ways and require the same
tokens, blocks, prefix hits, preemptions, routing and step counts, and the same times up to
floating-point rounding of the sums.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from bench.sim_agreement import Fixed  # runs the given deployments from t = 0
from flexpipe.engine.block_manager import BlockManager
from flexpipe.engine.core import EngineCore
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.engine.scheduler import Scheduler, SchedulerConfig
from flexpipe.gears.gear import Gear
from flexpipe.perf import BatchShape, perf_model_for
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.instance import SimInstance
from flexpipe.sim.loop import ARRIVAL, CONTROL, SCRAPE, EventLoop
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario, parse_scenario
from flexpipe.sim.simulator import SimResult, simulate
from flexpipe.sim.stretch import SIM_GEN_IDS, fast_forward, plan_stretch, price

ONE_A100 = {"name": "a", "nodes": [{"name": "n0", "network": "eth100", "gpus": [
    {"id": "g0", "type": "A100-80G-SXM"}, {"id": "g1", "type": "L4"}]}]}  # fmt: skip


def _scenario(
    workload: dict[str, Any], duration_s: float = 60, seed: int = 1, **more: Any
) -> Scenario:
    doc = {**more,
        "name": "t", "duration_s": duration_s, "seed": seed, "report_interval_s": 10,
        "cluster": {"inline": ONE_A100},
        "models": [{"name": "m", "model": "llama-2-7b",
                    "slo": {"ttft_p99_ms": 2000, "tpot_p99_ms": 80}}],
        "workloads": [{"model": "m", **workload}],
    }  # fmt: skip
    return parse_scenario(doc, Path("."))


def _both(sc: Scenario, deps: tuple[Deployment, ...]) -> tuple[SimResult, SimResult]:
    fast = simulate(sc, Fixed(deps), stretches=True)
    slow = simulate(sc, Fixed(deps), stretches=False)
    return fast, slow


def _assert_same(fast: SimResult, slow: SimResult) -> None:
    def key(r: Any) -> tuple[Any, ...]:
        return (r.request_id, r.instance, r.num_generated_tokens, r.num_cached_tokens,
                r.num_preemptions, r.failed)  # fmt: skip

    assert [key(r) for r in fast.requests] == [key(r) for r in slow.requests]
    for a, b in zip(fast.requests, slow.requests, strict=True):
        for f in ("first_token_s", "last_token_s", "finish_s"):
            assert getattr(a, f) == pytest.approx(getattr(b, f), rel=1e-12, abs=1e-9)
    steps_fast = [r.instance.num_steps for r in fast.instances if r.instance]
    steps_slow = [r.instance.num_steps for r in slow.instances if r.instance]
    assert steps_fast == steps_slow
    assert fast.num_events < slow.num_events  # the point of it


def _dep(name: str, gpu: str, **gear: Any) -> Deployment:
    return Deployment(name, "m", "llama-2-7b", Gear(**gear), ((gpu,),))


def test_stretches_equal_stepping_under_kv_pressure_with_shared_prefixes() -> None:
    """The L4 holds few KV blocks: preemptions, a waiting queue, prefix hits, chunked prefill."""
    sc = _scenario({
        "arrivals": {"process": "gamma", "rate_per_s": 3, "cv": 2, "start_s": 30},
        "prompt_tokens": {"dist": "lognormal", "mean": 1800, "cv": 0.6, "max": 3500},
        "output_tokens": {"dist": "exponential", "mean": 400, "max": 1500},
        "shared_prefix": {"num_groups": 3, "num_tokens": 1024},
    }, duration_s=90, gateway={"max_queue_wait_s": 600})  # fmt: skip
    deps = (_dep("l4", "g1", max_num_seqs=64, max_num_batched_tokens=2048),)
    fast, slow = _both(sc, deps)
    _assert_same(fast, slow)
    done = [r for r in fast.requests if r.completed]
    assert len(done) > 100
    assert sum(r.num_preemptions for r in fast.requests) > 0
    assert sum(r.num_cached_tokens for r in done) > 0


def test_stretches_equal_stepping_with_two_instances_and_routing() -> None:
    sc = _scenario({
        "arrivals": {"process": "poisson", "rate_per_s": 6, "start_s": 30},
        "prompt_tokens": {"dist": "uniform", "min": 10, "max": 2000},
        "output_tokens": {"dist": "uniform", "min": 1, "max": 300},
    }, duration_s=80)  # fmt: skip
    deps = (_dep("big", "g0", max_num_seqs=32), _dep("small", "g1", max_num_seqs=8))
    fast, slow = _both(sc, deps)
    _assert_same(fast, slow)
    assert {r.instance for r in fast.requests if r.completed} == {"big", "small"}
    assert any(r.num_generated_tokens == 1 for r in fast.requests if r.completed)


def _core(
    num_blocks: int = 200, block_size: int = 16, max_len: int = 4096, lazy: bool = False
) -> EngineCore:
    pm = perf_model_for("llama-2-7b")
    sched = Scheduler(SchedulerConfig(max_model_len=max_len), BlockManager(num_blocks, block_size),
                      lazy)  # fmt: skip
    return EngineCore(sched, pm.step_time_s)


def _req(rid: str, prompt: int, out: int) -> EngineRequest:
    return EngineRequest(rid, list(range(1000 * int(rid), 1000 * int(rid) + prompt)),
                         SamplingParams(max_tokens=out), out, SIM_GEN_IDS)  # fmt: skip


@pytest.mark.parametrize("lazy", [False, True])
def test_a_stretch_stops_before_the_first_finish_and_before_blocks_run_out(lazy: bool) -> None:
    core = _core(num_blocks=20, lazy=lazy)
    a, b = _req("1", 20, 50), _req("2", 30, 9)
    t = 0.0
    for r in (a, b):
        core.add(r, t)
    plan = core.step(t)  # the prefills
    assert plan_stretch(core, plan, 1 << 20, False) == 0
    t += plan.duration_s
    core.complete(plan, t)
    plan = core.step(t)  # both decode: b has 8 tokens left, so 6 virtual steps
    assert plan.batch.num_decode_seqs == 2
    assert plan_stretch(core, plan, 1 << 20, False) == 9 - 1 - 2
    assert plan_stretch(core, plan, 3, False) == 3
    tight = _core(num_blocks=6, lazy=lazy)
    c, d = _req("3", 31, 100), _req("4", 31, 100)
    for r in (c, d):
        tight.add(r, 0)
    p = tight.step(0)
    tight.complete(p, 1)
    p = tight.step(1)  # each holds 2 blocks (32 tokens + 1): 2 free blocks left
    assert tight.scheduler.bm.num_free_blocks == 2
    # virtual step i allocates for 33 + i - 1 tokens: a third block each at i = 1 (the two
    # free ones), a fourth at i = 17: none left, so the stretch ends after step 16
    assert plan_stretch(tight, p, 1 << 20, False) == 16


@pytest.mark.parametrize("lazy", [False, True])
def test_fast_forward_equals_stepping_on_one_core(lazy: bool) -> None:
    """Same engine, two copies: one stepped, one fast-forwarded (with lazy decodes: its
    scheduler's `advance`); equal state afterwards."""
    cores = [_core(num_blocks=300, lazy=lazy), _core(num_blocks=300)]
    for core in cores:
        for i, (p, o) in enumerate(((40, 200), (100, 150), (17, 90)), start=1):
            core.add(_req(str(i), p, o), 0.0)
    states = []
    for k, core in enumerate(cores):
        t = 0.0
        plan = core.step(t)
        while plan.admitted or plan.batch.num_prefill_seqs:
            t += plan.duration_s
            core.complete(plan, t)
            plan = core.step(t)
        m = plan_stretch(core, plan, 1 << 20, False)
        assert m == 90 - 2 - 1  # the shortest has 90 - 1 tokens left after its first
        st = price(core, plan, m)
        t1 = t + plan.duration_s
        if k == 0:  # fast: complete the planned step, then m virtual ones
            core.complete(plan, t1)
            fast_forward(core, [r for r, _, _ in plan.scheduled], m, t1 + st.elapsed_s(m))
            t_end = t1 + st.elapsed_s(m)
        else:
            core.complete(plan, t1)
            t_end = t1
            for _ in range(m):
                step_plan = core.step(t_end)
                t_end += step_plan.duration_s
                core.complete(step_plan, t_end)
        sched = core.scheduler
        for r in sched.running:
            sched.materialize(r)
        states.append((
            t_end,
            [(r.request_id, r.num_tokens, r.num_computed_tokens, r.kv.describe(),
              list(sched.bm.block_hashes(r.kv)), None if lazy else r.kv.num_cached_blocks,
              r.token_ids[-3:], r.last_token_s) for r in sched.running],
            sched.bm.free_entries(), sched.bm.cached,
        ))  # fmt: skip
    (t_fast, run_fast, *rest_fast), (t_slow, run_slow, *rest_slow) = states
    assert t_fast == pytest.approx(t_slow, rel=1e-12)
    assert rest_fast == rest_slow
    for a, b in zip(run_fast, run_slow, strict=True):
        assert a[:-1] == b[:-1] and a[-1] == pytest.approx(b[-1], rel=1e-12)


@pytest.mark.parametrize(
    ("model", "gear", "gpu", "link"),
    [
        ("llama-2-7b", "tp=1", "A100-80G-SXM", "nvlink3"),
        ("llama-2-13b", "tp=2", "L40S", "pcie4"),
        ("llama-2-13b", "tp=1,pp=2", "L4", "eth100"),
        ("mixtral-8x7b", "tp=4", "H100-80G-SXM", "nvlink4"),
    ],
)
def test_decode_step_time_is_affine_in_context(model: str, gear: str, gpu: str, link: str) -> None:
    """The closed form's premise: at a fixed batch size, a decode step's time is affine in the
    batch's context tokens (so consecutive steps form an arithmetic progression)."""
    pm = perf_model_for(model, gear, gpu, link)
    for b in (1, 7, 64):
        t = [pm.step_time_s(BatchShape(num_decode_seqs=b, decode_context_tokens=b * c))
             for c in (10, 11, 500, 4000)]  # fmt: skip
        slope = t[1] - t[0]
        assert t[2] == pytest.approx(t[0] + 490 * slope, rel=1e-9)
        assert t[3] == pytest.approx(t[0] + 3990 * slope, rel=1e-9)
        assert slope > 0


def _instance_run(stretches: bool, seed: int, num_kv_blocks: int) -> tuple[list[Any], ...]:
    """One engine on the virtual clock, driven by a seeded script of arrivals (bursts and
    singles), scrapes (`metrics`, which syncs inside a stretch), moves off (`take`) and, at
    a third of the finishes, a new request routed to it at that very time (a freed slot
    wakes the gateway's queue: it may cut the stretch in progress). Everything it reports."""
    sc = _scenario({"arrivals": {"process": "poisson", "rate_per_s": 1},
                    "prompt_tokens": {"dist": "uniform", "min": 10, "max": 20},
                    "output_tokens": {"dist": "uniform", "min": 1, "max": 2}})  # fmt: skip
    dep = _dep("l4", "g1", max_num_seqs=24, max_num_batched_tokens=512)
    cfg = replace(engine_config(dep, sc.cluster), num_kv_blocks=num_kv_blocks)
    loop = EventLoop()
    done: list[tuple[int, float, int, int, int, str]] = []
    firsts: list[tuple[int, float]] = []
    scraped: list[tuple[float, dict[str, float]]] = []
    rng = random.Random(seed)
    next_id = [1000]

    def request(rid: int, arrival_s: float) -> SimRequest:
        prefix = tuple(range(rng.randrange(3))) if rid % 2 else ()
        return SimRequest(rid, arrival_s, "m", rng.randrange(20, 400), rng.randrange(1, 160),
                          prefix_ids=prefix)  # fmt: skip

    def on_done(inst: SimInstance, req: SimRequest, ereq: EngineRequest, now: float) -> None:
        done.append((req.request_id, now, ereq.num_output_tokens, ereq.num_cached_tokens,
                     ereq.num_preemptions, ereq.finish_reason or ""))  # fmt: skip
        if req.request_id % 3 == 0 and next_id[0] < 1300:  # the queue's head comes in now
            next_id[0] += 1
            inst.submit(request(next_id[0], now), now)

    def on_first(inst: SimInstance, req: SimRequest, ereq: EngineRequest, now: float) -> None:
        firsts.append((req.request_id, now))

    inst = SimInstance(dep, cfg, loop, on_done, lambda *_: None, stretches, on_first)
    t = 0.0
    for rid in range(160):
        t += rng.expovariate(40) if rng.random() < 0.8 else rng.uniform(0.5, 2)
        loop.at(t, ARRIVAL, functools.partial(lambda r, now: inst.submit(r, now),
                                              request(rid, t)))  # fmt: skip
    for _ in range(120):  # scrapes, some at once after an arrival
        at_s = rng.uniform(0, t + 5)
        loop.at(at_s, SCRAPE, lambda now: scraped.append((now, inst.metrics(now))))
    taken: list[tuple[int, float, int]] = []

    def take(rid: int, now: float) -> None:
        req = next((r for r in inst.requests.values() if r.request_id == rid), None)
        if req is not None:
            ereq = inst.take(req, now)
            taken.append((rid, now, -1 if ereq is None else ereq.num_output_tokens))

    for rid in rng.sample(range(160), 12):
        loop.at(rng.uniform(0, t), CONTROL, functools.partial(take, rid))
    loop.run(t + 60)
    inst.sync(loop.now_s)  # (a stretch may be in progress)
    bm = inst.core.scheduler.bm
    engine = [(inst.num_steps, inst.core.scheduler.num_preemptions, bm.free_entries(),
               bm.cached)]  # fmt: skip
    return done, firsts, scraped, taken, engine, [inst.num_events, next_id[0] - 1000]


def _same_times(a: list[Any], b: list[Any]) -> None:
    """Equal records, their float fields equal up to the closed form's rounding."""
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert [v for v in x if not isinstance(v, float)] == [
            v for v in y if not isinstance(v, float)
        ]
        for u, v in zip(x, y, strict=True):
            if isinstance(u, float):
                assert u == pytest.approx(v, rel=1e-12, abs=1e-12)


@pytest.mark.parametrize(("seed", "num_kv_blocks"), [(1, 4000), (2, 90), (3, 60)])
def test_an_instance_with_stretches_reports_as_stepping(seed: int, num_kv_blocks: int) -> None:
    """One `SimInstance` with stretches against one stepping, driven by the same script:
    arrivals and scrapes inside stretches, requests routed to it at a finish, moves off,
    and (few KV blocks) preemption and a waiting queue. Every finish, first token, scrape
    and move, and the final block state, agree."""
    fast = _instance_run(True, seed, num_kv_blocks)
    slow = _instance_run(False, seed, num_kv_blocks)
    done, firsts, scraped, taken, engine, events = fast
    for a, b in zip(fast[:4], slow[:4], strict=True):
        _same_times(a, b)
    assert engine == slow[4]
    assert events[0] < slow[5][0]  # fewer events
    assert len(done) > 40 and len(firsts) >= len(done) and len(scraped) == 120 and taken
    assert events[1] > 10  # requests routed to it at a finish
    if num_kv_blocks < 100:
        assert engine[0][1] > 0  # preemptions

"""Sim engines sharing one GPU in memory (sim/colocation.py): slower together than apart by
the contention model's factor, each sized from its own memory fraction, the GPU billed once."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from flexpipe.cluster import parse_cluster_yaml
from flexpipe.gears.gear import Gear
from flexpipe.perf.colocation import stretch
from flexpipe.sim.colocation import Colocation
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_config
from flexpipe.sim.instance import SimInstance
from flexpipe.sim.loop import ARRIVAL, EventLoop
from flexpipe.sim.request import SimRequest
from flexpipe.sim.scenario import Scenario, ScenarioError, parse_scenario
from flexpipe.sim.simulator import simulate
from flexpipe.sim.usage import Usage

CLUSTER = parse_cluster_yaml(
    "name: one\nnodes:\n  - name: n0\n    gpus: [{id: g0, type: A100-80G-SXM}]\n"
)


def _dep(name: str, fraction: float | None) -> Deployment:
    return Deployment(name, name, "qwen2.5-7b", Gear(max_num_seqs=8), (("g0",),), (28,), fraction)


def _run(deps: list[Deployment]) -> dict[str, list[tuple[float, float]]]:
    """One request (512 prompt tokens, 32 output) to each engine at t = 0: each engine's
    step spans (start, end)."""
    loop = EventLoop()
    colocation = Colocation()
    spans: dict[str, list[tuple[float, float]]] = {d.name: [] for d in deps}

    def done(*_: Any) -> None:
        pass

    for k, dep in enumerate(deps):
        cfg = engine_config(dep, CLUSTER)

        def on_busy(start_s: float, end_s: float, name: str = dep.name) -> None:
            spans[name].append((start_s, end_s))

        inst = SimInstance(dep, cfg, loop, done, on_busy, colocation=colocation)
        req = SimRequest(k, 0.0, dep.model, 512, 32)
        loop.at(0.0, ARRIVAL, lambda now, i=inst, r=req: i.submit(r, now))
    loop.run(1e9)
    return spans


def test_two_engines_on_one_gpu_are_slower_together_by_the_model_factor() -> None:
    alone = _run([_dep("a", 0.4)])["a"]
    together = _run([_dep("a", 0.4), _dep("b", 0.4)])
    assert len(alone) == len(together["a"]) == len(together["b"]) == 32  # prefill + 31 decodes
    step = [e - s for s, e in alone]
    # `a` started first, alone on the GPU (its first step: 1x); every later step of `a` and
    # every step of `b` but its last starts while the other computes: 2 x (1 + 5%) = 2.1x
    a = [e - s for s, e in together["a"]]
    b = [e - s for s, e in together["b"]]
    assert a[0] == pytest.approx(step[0])
    assert a[1:] == pytest.approx([stretch(2) * x for x in step[1:]])
    assert b[:-1] == pytest.approx([stretch(2) * x for x in step[:-1]])
    assert b[-1] == pytest.approx(step[-1])  # `a` had finished: alone again
    assert stretch(2) == pytest.approx(2.1)


def test_engines_alone_on_their_gpu_are_untouched() -> None:
    """Without a memory fraction an engine never joins: no factor, stretches kept."""
    plain = _run([_dep("a", None)])["a"]
    shared = _run([_dep("a", 0.4)])["a"]
    assert sum(e - s for s, e in plain) == pytest.approx(sum(e - s for s, e in shared))


def test_each_engine_sizes_its_kv_cache_from_its_own_fraction() -> None:
    small = engine_config(_dep("a", 0.3), CLUSTER)
    large = engine_config(_dep("b", 0.5), CLUSTER)
    whole = engine_config(_dep("c", None), CLUSTER)
    assert (small.gpu_memory_utilization, large.gpu_memory_utilization) == (0.3, 0.5)
    assert whole.gpu_memory_utilization == 0.9
    assert small.num_kv_blocks < large.num_kv_blocks < whole.num_kv_blocks
    # the KV bytes differ by exactly the 0.2 of the GPU's memory between the fractions
    pm = small.pm
    block_bytes = pm.memory.kv_bytes_per_token * pm.memory.block_size
    gap = (large.num_kv_blocks - small.num_kv_blocks) * block_bytes
    assert gap == pytest.approx(0.2 * CLUSTER.gpu("g0").spec.memory_bytes, rel=1e-3)


def test_a_shared_gpu_is_billed_once() -> None:
    usage = Usage(100.0, 10.0)
    usage.hold(("g0",), True, 0.0, 30.0)
    usage.hold(("g0",), True, 20.0, 50.0)  # overlaps: g0 held 0..50 once
    usage.hold(("g1",), False, 0.0, 10.0)
    busy = usage.on_busy(("g0",), True)
    busy(1.0, 3.0)
    busy(2.0, 4.0)  # both computing 2..3: busy 1..4 once
    usage.close(100.0)
    assert sum(usage.reserved_gpu_s) == pytest.approx(50.0 + 10.0)
    assert sum(usage.busy_gpu_s) == pytest.approx(3.0)
    assert usage.last_busy_s == 4.0


def _scenario(share: object) -> Scenario:
    doc = {
        "name": "two-small-models", "duration_s": 120, "seed": 3, "report_interval_s": 10,
        "cluster": {"inline": {"name": "one", "nodes": [{"name": "n0", "gpus": [
            {"id": "g0", "type": "A100-80G-SXM"}, {"id": "g1", "type": "A100-80G-SXM"}]}]}},
        "models": [
            {"name": "chat-8b", "model": "llama-3.1-8b",
             "slo": {"ttft_p99_ms": 2500, "tpot_p99_ms": 80}},
            {"name": "summarise-7b", "model": "qwen2.5-7b",
             "slo": {"ttft_p99_ms": 2500, "tpot_p99_ms": 80}},
        ],
        "workloads": [
            {"model": m, "arrivals": {"process": "poisson", "rate_per_s": 0.3},
             "prompt_tokens": {"dist": "fixed", "mean": 1024},
             "output_tokens": {"dist": "fixed", "mean": 200}}
            for m in ("chat-8b", "summarise-7b")
        ],
        "planner": {"share_gpus": share},
    }  # fmt: skip
    return parse_scenario(doc, Path("."))


def test_a_run_with_two_models_on_one_gpu_bills_it_once() -> None:
    """`planner: {share_gpus: true}`: the static plan puts both models on g0, each engine
    with its fraction; the run's reserved GPU time is one GPU's, not two."""
    shared = simulate(_scenario(True), "static")
    alone = simulate(_scenario(False), "static")
    assert [(r.dep.gpu_ids, r.dep.gpu_memory_fraction) for r in shared.instances] == [
        (("g0",), 0.3),
        (("g0",), 0.26),
    ]
    assert [r.dep.gpu_ids for r in alone.instances] == [("g0",), ("g1",)]
    run_s = shared.usage.end_s
    loaded_s = max(r.launched_s for r in shared.instances)
    assert sum(shared.usage.reserved_gpu_s) == pytest.approx(run_s - loaded_s)
    assert sum(alone.usage.reserved_gpu_s) == pytest.approx(2 * alone.usage.end_s)
    # the same requests served (those sent before the engines loaded got a 404 either way)
    assert [r.failed for r in shared.requests] == [r.failed for r in alone.requests]
    assert sum(r.failed == "" for r in shared.requests) == 55


class _Tenant:
    def __init__(self, *gpu_ids: str) -> None:
        self.gpu_ids = gpu_ids
        self.computing = True


def test_an_engine_released_leaves_its_gpus_neighbours() -> None:
    """A released engine slows nobody and is forgotten (a long run packs and unpacks often)."""
    colocation = Colocation()
    a, b, c = _Tenant("g0"), _Tenant("g0", "g1"), _Tenant("g1")
    for t in (a, b, c):
        colocation.join(t)
    assert colocation.factor(a) == stretch(2)
    assert colocation.factor(b) == stretch(3)
    colocation.leave(b)
    assert colocation.factor(a) == stretch(1)
    assert colocation.factor(c) == stretch(1)
    assert (colocation.num_tenants("g0"), colocation.num_tenants("g1")) == (1, 1)
    colocation.leave(a)
    colocation.leave(a)  # twice: nothing more
    assert colocation.num_tenants("g0") == 0


def test_the_scenario_key_is_a_boolean() -> None:
    assert _scenario(True).planner.share_gpus is True
    assert _scenario(False).planner.share_gpus is False
    with pytest.raises(ScenarioError, match="share_gpus: use true or false"):
        _scenario("yes")

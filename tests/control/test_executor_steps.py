"""The order of in-place replacements, planned before anything changes (pure)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import yaml

from flexpipe.cluster import load_cluster
from flexpipe.control.executor import LiveInstance
from flexpipe.policies.planner import PlannedInstance, parse_models, plan
from flexpipe.policies.shift.snapshot import instance_key
from flexpipe.policies.shift.step_order import plan_shift, rolling_steps

ROOT = Path(__file__).resolve().parents[2]
CLUSTER = load_cluster(ROOT / "examples/clusters/fragmented-4gpu.yaml")
(DEMAND,) = parse_models(yaml.safe_load((ROOT / "examples/models/llama-7b.yaml").read_text()), "m")


def live(p: PlannedInstance) -> LiveInstance:
    handle: Any = object()  # the steps never touch the engine
    return LiveInstance(p, handle)


def relaunched(p: PlannedInstance) -> PlannedInstance:
    """The same GPUs in another gear (what an in-place target looks like)."""
    return replace(p, gear=replace(p.gear, max_num_seqs=p.gear.max_num_seqs + 8))


def test_every_instance_replaced_in_place_goes_one_group_at_a_time() -> None:
    running = plan(CLUSTER, [DEMAND]).instances
    by_gpus = {tuple(sorted(p.gpu_ids)): p for p in running}
    pair, l40s, l4 = by_gpus[("gpu1", "gpu2")], by_gpus[("gpu3",)], by_gpus[("gpu0",)]
    new_pair, new_l40s = relaunched(pair), relaunched(l40s)
    steps = rolling_steps(running, [pair, l40s], [new_pair, new_l40s])
    assert steps == [((pair,), (new_pair,)), ((l40s,), (new_l40s,))]
    # the L4 alone is replaced in place while the others serve
    assert rolling_steps(running, [l4], [relaunched(l4)]) is not None


def test_a_model_with_nothing_else_serving_is_not_replaced_in_place() -> None:
    (only,) = [p for p in plan(CLUSTER, [DEMAND]).instances if p.num_gpus == 2]
    assert rolling_steps([only], [only], [relaunched(only)]) is None


def test_a_model_left_out_of_the_target_scales_to_zero_only_when_asked() -> None:
    """The live executor scales a model the target has none of to zero (its gateway holds
    the requests); without `scale_to_zero` that is a gap and the shift is refused."""
    running = plan(CLUSTER, [DEMAND]).instances
    assert "serving would stop" in plan_shift(running, []).refusal
    to_zero = plan_shift(running, [], scale_to_zero=True)
    assert to_zero.refusal == "" and to_zero.steps == () and to_zero.rest == tuple(running)


class Recorder:
    """Stands in at the I/O seam (launcher and gateway): records each call."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def __getattr__(self, name: str) -> Any:
        async def call(*args: Any, **kwargs: Any) -> Any:
            self.calls.append(name)
            raise AssertionError(f"{name} called: a refused shift changes nothing")

        return call


def test_a_refused_shift_changes_nothing_and_says_it_was_refused() -> None:
    """Replacing the only instance of a model in place would stop serving it: the executor
    refuses before any launch or gateway call, and marks the outcome refused (not a failure
    of the target: the controller records it so and the blacklist ignores it)."""
    import asyncio

    from flexpipe.control.core.shift_outcome import finished_record
    from flexpipe.control.executor import Executor
    from flexpipe.policies.shift.snapshot import ShiftRecord

    (only,) = [p for p in plan(CLUSTER, [DEMAND]).instances if p.num_gpus == 2]
    running = {instance_key(only): live(only)}
    io = Recorder()
    executor = Executor(io, io, lambda p: None)  # type: ignore[arg-type,return-value]
    out = asyncio.run(executor.shift(CLUSTER, running, [relaunched(only)]))
    assert (out.succeeded, out.refused, io.calls) == (False, True, [])
    assert "serving would stop" in out.reason
    assert list(running) == [instance_key(only)]
    new = instance_key(relaunched(only))
    record = finished_record(ShiftRecord(10.0, target_keys=(new,)), out, 12.0)
    assert record == ShiftRecord(10.0, 12.0, False, (new,), refused=True)
    assert not record.failed

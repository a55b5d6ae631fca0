"""A planned instance -> the engine config and engine core the sim engine would run.

`flexpipe up` launches `python -m flexpipe.engine.sim` with `vllm_flags(spec)` plus
`--cluster FILE --gpu-ids ...`; `parse_engine_args` turns them into an `EngineConfig` (a
`PerfModel` on `placement_on(cluster, stages, ...)`, the memory plan's KV blocks and
max_model_len, the modelled cold start), and `SimServer.__init__` builds the block manager,
scheduler and step time from it. `engine_config` makes the same `EngineConfig` from the
objects in memory (no cluster file, no process); `engine_core` (flexpipe.engine.build, the
function `SimServer.__init__` calls) builds the core from it.
"""

from __future__ import annotations

from flexpipe.cluster import Cluster, placement_on
from flexpipe.engine.args import EngineConfig
from flexpipe.engine.build import engine_core
from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import PerfModel
from flexpipe.sim.deployment import Deployment

# what `vllm_flags` (flexpipe/launch/local.py) passes as --scheduling-policy: a request the
# controller moves comes with a negative priority and takes the next free slot
SCHEDULING_POLICY = "priority"


def engine_config(
    dep: Deployment,
    cluster: Cluster,
    max_model_len: int | None = None,
    gpu_memory_utilization: float | None = None,
) -> EngineConfig:
    """Raises ValueError (InfeasibleGear, GearError) when the gear cannot run there.
    `gpu_memory_utilization` None: the deployment's memory fraction when it shares its GPU
    (its KV cache sized from its own fraction, as vLLM's), else
    `DEFAULT_GPU_MEMORY_UTILIZATION` (what `flexpipe up` launches with)."""
    if gpu_memory_utilization is None:
        gpu_memory_utilization = dep.gpu_memory_fraction or DEFAULT_GPU_MEMORY_UTILIZATION
    model = load_model_spec(dep.model_id)
    gear = dep.gear
    placement = placement_on(cluster, dep.stages, model.num_layers, dep.layers_per_stage or None)
    pm = PerfModel(model, gear, placement, None, gpu_memory_utilization, max_model_len)
    pm.require_feasible()
    return EngineConfig(
        model=model,
        model_path=dep.model_id,
        served_model_names=(dep.model,),
        host="sim",
        port=0,
        gear=gear,
        pm=pm,
        max_model_len=pm.memory.max_model_len,
        num_kv_blocks=pm.memory.num_kv_blocks,
        enable_chunked_prefill=True,
        scheduling_policy=SCHEDULING_POLICY,
        gpu_memory_utilization=gpu_memory_utilization,
        api_key=None,
        admin_token=None,
        seed=0,
        time_scale=0.0,
        load_time_s=pm.cold_start_s(),
        max_request_body_bytes=0,
        log_level="warning",
        ignored_flags=(),
        hardware=f"{dep.name}: {'; '.join(','.join(s) for s in dep.stages)}",
    )


__all__ = ["SCHEDULING_POLICY", "engine_config", "engine_core"]

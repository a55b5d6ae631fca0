"""From a plan to engines: the models file and the launcher's view of a planned instance
(shared by `flexpipe up`, `flexpipe controller` and gear_bench's callers)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from pathlib import Path

import yaml

from flexpipe.cluster import Cluster
from flexpipe.cluster.topology import sub_cluster
from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION
from flexpipe.launch import EngineSpec, GpuPlace
from flexpipe.perf.memory import engine_budget_bytes
from flexpipe.policies.planner import ModelDemand, PlannedInstance, parse_models
from flexpipe.policies.planner.checkpoint import checkpoint_for

__all__ = [
    "ModelsFileError",
    "engine_spec",
    "gpu_memory_utilization",
    "gpu_places",
    "load_models",
    "with_sleep_mode",
]


class ModelsFileError(ValueError):
    """The models file cannot be used; one line for the user."""


def load_models(path: Path) -> tuple[ModelDemand, ...]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ModelsFileError(f"{path}: cannot read the file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ModelsFileError(f"{path}: YAML syntax error: {exc}") from None
    return parse_models(doc, str(path))


def gpu_places(cluster: Cluster, gpu_ids: Sequence[str]) -> tuple[GpuPlace, ...]:
    """Where each GPU is: its node, its device index there and its type (what launchers on
    other machines and the DCGM join, flexpipe/observe/dcgm.py, need)."""
    return tuple(
        GpuPlace(g, cluster.gpu(g).node, cluster.gpu(g).index, cluster.gpu(g).type) for g in gpu_ids
    )


def gpu_memory_utilization(
    cluster: Cluster, gpu_ids: Sequence[str], utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
) -> float:
    """The engine's `--gpu-memory-utilization` (vLLM: a fraction of each GPU's whole memory):
    what the planner's memory plan gave it on its tightest GPU, other tenants' memory
    subtracted (flexpipe.perf.memory.engine_budget_bytes), rounded down to 1/1000."""
    fractions = [
        engine_budget_bytes(cluster.slot(g), utilization) / cluster.gpu(g).spec.memory_bytes
        for g in gpu_ids
    ]
    return math.floor(min(fractions, default=utilization) * 1000) / 1000


def engine_spec(
    inst: PlannedInstance,
    cluster: Cluster,
    cluster_file: str,
    demands: Sequence[ModelDemand],
    admin_token: str | None = None,
    *,
    enable_sleep_mode: bool = False,
) -> EngineSpec:
    """The launcher's view of a planned instance (one that shares its GPU is launched with
    its own memory fraction as `--gpu-memory-utilization`: vLLM's per-instance share of the
    GPU's whole memory, docs/gpu-sharing.md). `admin_token` is handed to the engine
    through its environment (not its command line), for the controller's KV moves. Real
    engines load the checkpoint the models file names for the gear's precision."""
    gpu_ids = tuple(g for stage in inst.stages for g in stage)
    demand = next((d for d in demands if d.name == inst.model), None)
    max_len = demand.max_model_len if demand else None
    ckpt = (
        checkpoint_for(inst.gear.dtype, demand.weights, demand.checkpoints)
        if demand is not None and demand.weights
        else None
    )
    env: list[tuple[str, str]] = []
    if len(set(inst.layers_per_stage)) > 1:
        # vLLM reads an uneven pipeline split from this variable (the sim splits evenly).
        env.append(("VLLM_PP_LAYER_PARTITION", ",".join(map(str, inst.layers_per_stage))))
    if admin_token:
        env.append(("FLEXPIPE_ADMIN_TOKEN", admin_token))
    spec = EngineSpec(
        model=inst.model_id,
        gear=inst.gear,
        name=inst.name,
        gpu_ids=gpu_ids,
        gpu_indices=tuple(cluster.gpu(g).index for g in gpu_ids),
        cluster_file=cluster_file,
        served_model_name=inst.model,
        max_model_len=max_len,
        env=tuple(env),
        placement=gpu_places(cluster, gpu_ids),
        topology=sub_cluster(cluster, gpu_ids).to_yaml(),
        gpu_memory_utilization=gpu_memory_utilization(
            cluster, gpu_ids, inst.gpu_memory_fraction or DEFAULT_GPU_MEMORY_UTILIZATION
        ),
        weights=ckpt.path if ckpt else None,
        quantization=ckpt.quantization if ckpt else None,
    )
    return with_sleep_mode(spec) if enable_sleep_mode else spec


def with_sleep_mode(spec: EngineSpec) -> EngineSpec:
    """`spec` able to sleep and wake: `--enable-sleep-mode`, and the endpoints mounted
    (vLLM serves /sleep, /wake_up and /is_sleeping only with VLLM_SERVER_DEV_MODE=1; the
    sim engine reads the same variable)."""
    env = tuple((k, v) for k, v in spec.env if k != "VLLM_SERVER_DEV_MODE")
    return dataclasses.replace(
        spec, enable_sleep_mode=True, env=(*env, ("VLLM_SERVER_DEV_MODE", "1"))
    )

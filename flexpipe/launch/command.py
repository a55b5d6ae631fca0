"""The engine's command line for an EngineSpec, one for every launcher.

`engine="sim"` runs `python -m flexpipe.engine.sim MODEL <vllm flags> <sim flags>`;
`engine="vllm"` runs `vllm serve MODEL <the same vllm flags>`. A launcher whose engines run
on other machines (Ray) passes placeholders (`{host}`, `{port}`, `{topology}`) that are
filled in where the engine starts.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flexpipe.launch.base import EngineSpec

__all__ = [
    "ENGINES",
    "SIM_COMMAND",
    "VLLM_COMMAND",
    "check_engine",
    "engine_argv",
    "sim_flags",
    "vllm_flags",
]

SIM_COMMAND: tuple[str, ...] = (sys.executable, "-m", "flexpipe.engine.sim")
VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
ENGINES = ("sim", "vllm")


def check_engine(engine: str) -> None:
    if engine not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; use one of {', '.join(ENGINES)}")


def vllm_flags(spec: EngineSpec, host: str, port: int | str) -> list[str]:
    """The `vllm serve` flags for a gear (the sim engine accepts the same)."""
    g = spec.gear
    flags = [
        spec.model,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(g.tp),
        "--pipeline-parallel-size",
        str(g.pp),
        "--max-num-seqs",
        str(g.max_num_seqs),
        "--max-num-batched-tokens",
        str(g.max_num_batched_tokens),
        "--block-size",
        str(g.block_size),
        "--kv-cache-dtype",
        g.kv_cache_dtype,
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--enable-prefix-caching" if g.enable_prefix_caching else "--no-enable-prefix-caching",
        # a request moved off a drained instance is sent with a negative priority: it takes
        # the next free slot ahead of the queue (every other request has priority 0: FCFS)
        "--scheduling-policy",
        "priority",
    ]
    if g.dtype in ("bf16", "fp16", "fp32"):
        flags += ["--dtype", {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[g.dtype]]
    elif g.dtype == "fp8":
        flags += ["--quantization", "fp8"]
    elif g.dtype == "int8":
        flags += ["--quantization", "int8"]
    elif g.dtype == "int4":
        flags += ["--quantization", "awq"]
    if spec.served_model_name:
        flags += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len:
        flags += ["--max-model-len", str(spec.max_model_len)]
    return flags + list(spec.extra_args)


def sim_flags(
    spec: EngineSpec, cluster: str | None, time_scale: float, load_time_s: float | None
) -> list[str]:
    """The sim engine's own flags: the GPUs it stands for are `spec.gpu_ids` of the cluster
    document at `cluster` when both are given, else every rank of `spec.gpu_type`."""
    sim = ["--time-scale", repr(time_scale)]
    if cluster and spec.gpu_ids:
        sim += ["--cluster", cluster, "--gpu-ids", stage_ids(spec)]
    else:
        sim += ["--gpu-type", spec.gpu_type, "--link", spec.link]
        if spec.pp_link:
            sim += ["--pp-link", spec.pp_link]
    if load_time_s is not None:
        sim += ["--load-time-s", repr(load_time_s)]
    return sim


def engine_argv(
    engine: str,
    spec: EngineSpec,
    host: str,
    port: int | str,
    *,
    sim_command: Sequence[str],
    vllm_command: Sequence[str],
    cluster: str | None,
    time_scale: float,
    load_time_s: float | None,
) -> list[str]:
    """The whole argv of `engine` ("sim" or "vllm") for a spec."""
    flags = vllm_flags(spec, host, port)
    if engine == "vllm":
        return [*vllm_command, *flags]
    return [*sim_command, *flags, *sim_flags(spec, cluster, time_scale, load_time_s)]


def stage_ids(spec: EngineSpec) -> str:
    """`--gpu-ids`: the pipeline's stages split by `;`, each stage's tp GPUs by `,`."""
    tp = spec.gear.tp
    ids = list(spec.gpu_ids)
    return ";".join(",".join(ids[i : i + tp]) for i in range(0, len(ids), tp))

"""The engine's command line and environment for an EngineSpec, one for every launcher.

`engine="sim"` runs `python -m flexpipe.engine.sim MODEL <vllm flags> <sim flags>`;
`engine="vllm"` runs `vllm serve WEIGHTS <the same vllm flags>`; `engine="sglang"` runs
`python -m sglang.launch_server --model-path WEIGHTS <sglang flags>` for the same plan. A
launcher whose engines run on other machines (Ray) passes placeholders (`{host}`, `{port}`,
`{topology}`) that are filled in where the engine starts.

Every flag and variable emitted here is checked against the engine's own argument table for a
pinned release (tests/data/README-engine-args.md, tests/engine/test_engine_commands.py).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from flexpipe.engine_kinds import ENGINE_KINDS, engine_kind
from flexpipe.launch.base import EngineSpec, LaunchError
from flexpipe.model_spec import ModelSpecError, load_model_spec
from flexpipe.precision import precision

__all__ = [
    "ENGINES",
    "SGLANG_COMMAND",
    "SIM_COMMAND",
    "VLLM_COMMAND",
    "EngineCommandError",
    "check_engine",
    "engine_argv",
    "engine_env",
    "sglang_flags",
    "sim_flags",
    "vllm_flags",
]

SIM_COMMAND: tuple[str, ...] = (sys.executable, "-m", "flexpipe.engine.sim")
VLLM_COMMAND: tuple[str, ...] = ("vllm", "serve")
SGLANG_COMMAND: tuple[str, ...] = (sys.executable, "-m", "sglang.launch_server")
ENGINES = tuple(ENGINE_KINDS)

# flexpipe's KV cache dtypes -> each engine's `--kv-cache-dtype` (16-bit KV in the model's
# own dtype is "auto" for both: an explicit 16-bit dtype must match the weights in vLLM)
_KV_CACHE_DTYPES: dict[str, dict[str, str]] = {
    "vllm": {
        "auto": "auto",
        "bf16": "auto",
        "fp16": "auto",
        "fp8": "fp8",
        "fp8_e4m3": "fp8_e4m3",
        "fp8_e5m2": "fp8_e5m2",
    },
    "sglang": {
        "auto": "auto",
        "bf16": "auto",
        "fp16": "auto",
        "fp8": "fp8_e4m3",
        "fp8_e4m3": "fp8_e4m3",
        "fp8_e5m2": "fp8_e5m2",
    },
}
# precisions that only a quantized checkpoint serves (policies/planner/checkpoint.py)
_NEEDS_CHECKPOINT = ("int8", "int4-awq", "int4-gptq")


class EngineCommandError(LaunchError, ValueError):
    """A spec this engine cannot be launched with; one readable line (a LaunchError from
    `Launcher.start`, raised before anything starts)."""


def check_engine(engine: str) -> None:
    engine_kind(engine)  # ValueError naming the known kinds


def weights(spec: EngineSpec) -> str:
    """What a real engine loads: the spec's weights, else the catalog's repo id of its model,
    else the model as given (a path)."""
    if spec.weights:
        return spec.weights
    try:
        return load_model_spec(spec.model).hf_repo or spec.model
    except ModelSpecError:
        return spec.model


def _quantization(spec: EngineSpec, real: bool) -> str | None:
    """`--quantization`: the checkpoint's method; fp8 without one is quantized as it loads.
    A real engine refuses int8/int4 without a named checkpoint (bf16 weights are not one);
    the sim engine only needs the method to know the precision it stands for."""
    if spec.quantization:
        return spec.quantization
    if real and spec.gear.dtype in _NEEDS_CHECKPOINT:
        raise EngineCommandError(
            f"engine {spec.name}: {spec.gear.dtype} needs a quantized checkpoint; name one "
            "under `checkpoints:` in the models file (docs/engines.md)"
        )
    return precision(spec.gear.dtype).vllm_quantization


def _kv_cache_dtype(engine: str, spec: EngineSpec) -> str:
    kv = spec.gear.kv_cache_dtype.lower()
    table = _KV_CACHE_DTYPES[engine]
    if kv not in table:
        raise EngineCommandError(
            f"engine {spec.name}: {engine} has no KV cache dtype {kv!r}; "
            f"use one of {', '.join(table)}"
        )
    return table[kv]


def _across_nodes(spec: EngineSpec) -> bool:
    return len({p.node for p in spec.placement}) > 1


def vllm_flags(spec: EngineSpec, host: str, port: int | str, *, real: bool = False) -> list[str]:
    """The `vllm serve` flags for a gear (the sim engine accepts the same). `real`: for vLLM
    itself (the model is the weights; refuses what vLLM cannot run), else for the sim engine
    (the model is the spec id it stands for)."""
    g = spec.gear
    flags = [
        weights(spec) if real else spec.model,
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
        _kv_cache_dtype("vllm", spec) if real else g.kv_cache_dtype,
        "--gpu-memory-utilization",
        str(spec.gpu_memory_utilization),
        "--enable-prefix-caching" if g.enable_prefix_caching else "--no-enable-prefix-caching",
        # a request moved off a drained instance is sent with a negative priority: it takes
        # the next free slot ahead of the queue (every other request has priority 0: FCFS)
        "--scheduling-policy",
        "priority",
    ]
    dtype = precision(g.dtype).vllm_dtype
    if dtype != "auto":
        flags += ["--dtype", dtype]
    quantization = _quantization(spec, real)
    if quantization:
        flags += ["--quantization", quantization]
    if spec.served_model_name:
        flags += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len:
        flags += ["--max-model-len", str(spec.max_model_len)]
    if spec.enable_sleep_mode:
        flags += ["--enable-sleep-mode"]
    if _across_nodes(spec):
        flags += ["--distributed-executor-backend", "ray"]
    return flags + list(spec.extra_args)


def sglang_flags(spec: EngineSpec, host: str, port: int | str) -> list[str]:
    """`python -m sglang.launch_server` flags for the same plan. SGLang caches prefixes by
    default (its radix cache); its metrics need `--enable-metrics`."""
    g = spec.gear
    if _across_nodes(spec):
        raise EngineCommandError(
            f"engine {spec.name}: its pipeline spans nodes, which flexpipe cannot launch "
            "with SGLang (docs/engines.md); use --engine vllm"
        )
    if spec.enable_sleep_mode:
        raise EngineCommandError(f"engine {spec.name}: SGLang has no sleep mode flexpipe uses")
    flags = [
        "--model-path",
        weights(spec),
        "--host",
        host,
        "--port",
        str(port),
        "--tp-size",
        str(g.tp),
        "--pp-size",
        str(g.pp),
        "--max-running-requests",
        str(g.max_num_seqs),
        "--chunked-prefill-size",
        str(g.max_num_batched_tokens),
        "--page-size",
        str(g.block_size),
        "--kv-cache-dtype",
        _kv_cache_dtype("sglang", spec),
        "--mem-fraction-static",
        str(spec.gpu_memory_utilization),
        # moved requests come with a negative priority, first in line as in vLLM
        "--enable-priority-scheduling",
        "--schedule-low-priority-values-first",
        "--enable-metrics",
    ]
    if not g.enable_prefix_caching:
        flags += ["--disable-radix-cache"]
    dtype = precision(g.dtype).vllm_dtype
    if dtype != "auto":
        flags += ["--dtype", dtype]
    quantization = _quantization(spec, real=True)
    if quantization:
        flags += ["--quantization", quantization]
    if spec.served_model_name:
        flags += ["--served-model-name", spec.served_model_name]
    if spec.max_model_len:
        flags += ["--context-length", str(spec.max_model_len)]
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
    sglang_command: Sequence[str] = SGLANG_COMMAND,
) -> list[str]:
    """The whole argv of `engine` ("sim", "vllm" or "sglang") for a spec."""
    check_engine(engine)
    if engine == "vllm":
        return [*vllm_command, *vllm_flags(spec, host, port, real=True)]
    if engine == "sglang":
        return [*sglang_command, *sglang_flags(spec, host, port)]
    flags = vllm_flags(spec, host, port)
    return [*sim_command, *flags, *sim_flags(spec, cluster, time_scale, load_time_s)]


def engine_env(engine: str, spec: EngineSpec, *, set_devices: bool = True) -> dict[str, str]:
    """The variables `engine` needs for a spec, beyond the spec's own (`spec.env`): the GPUs
    it may see (unless its launcher sets them, as Ray does), the sleep endpoints (vLLM serves
    them only in its dev mode), an uneven pipeline split under the engine's own name."""
    env = dict(spec.env)
    if engine == "sim":
        env.setdefault("PYTHONUNBUFFERED", "1")
        return env
    if set_devices and spec.gpu_indices:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(i) for i in spec.gpu_indices)
    if engine == "vllm" and spec.enable_sleep_mode:
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if engine == "sglang" and "VLLM_PP_LAYER_PARTITION" in env:
        env["SGLANG_PP_LAYER_PARTITION"] = env.pop("VLLM_PP_LAYER_PARTITION")
    return env


def stage_ids(spec: EngineSpec) -> str:
    """`--gpu-ids`: the pipeline's stages split by `;`, each stage's tp GPUs by `,`."""
    tp = spec.gear.tp
    ids = list(spec.gpu_ids)
    return ";".join(",".join(ids[i : i + tp]) for i in range(0, len(ids), tp))

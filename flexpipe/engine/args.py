"""`vllm serve` flags (plus the sim's own) -> a performance model and an engine config.

The vLLM flags a launcher passes are understood; any other vLLM flag is accepted with a
warning, so a launcher needs no special case for the sim. Sim-only flags say which hardware
the sim stands for: `--gpu-type` and `--link` (default: one A100-80G-SXM per tensor-parallel
rank, joined by NVLink 3), or `--cluster FILE --gpu-ids g1,g2,...` (in pipeline order, tp per
stage; `;` may separate stages explicitly).

Secrets stay out of `ps`: the API key comes from `--api-key-file FILE` or the environment
(`VLLM_API_KEY`, as vLLM reads it), the admin token from `--admin-token-file FILE` or
`FLEXPIPE_ADMIN_TOKEN`; `--api-key` / `--admin-token` on the command line still work.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from dataclasses import dataclass, replace

from flexpipe.gears.gear import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Gear,
    GearError,
    GpuSlot,
    uniform_placement,
)
from flexpipe.hardware import link_spec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import PerfModel
from flexpipe.perf.weights import KINDS, WeightSource, source_of
from flexpipe.precision import precision


class EngineArgsError(ValueError):
    """Flags that do not make a runnable engine; the message is one readable line."""


def _bool_flag(p: argparse.ArgumentParser, name: str, default: bool | None, help: str) -> None:
    p.add_argument(name, action=argparse.BooleanOptionalAction, default=default, help=help)


def build_parser(prog: str = "flexpipe engine sim") -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=prog,
        description="A vLLM-compatible server whose timing is flexpipe's performance model.",
    )
    p.add_argument("model_tag", nargs="?", default=None, help="the model (as `vllm serve MODEL`)")
    p.add_argument("--model", default=None, help="model id, HF repo id or config.json path")
    p.add_argument("--served-model-name", nargs="+", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=1)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--quantization", "-q", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=DEFAULT_GPU_MEMORY_UTILIZATION)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-gpu-blocks-override", type=int, default=None)
    _bool_flag(p, "--enable-prefix-caching", True, "prefix caching (default on)")
    _bool_flag(p, "--enable-chunked-prefill", True, "chunked prefill (default on)")
    p.add_argument("--api-key", default=None, help="or env VLLM_API_KEY, or --api-key-file")
    p.add_argument("--api-key-file", default=None, help="read the API key from this file")
    p.add_argument("--seed", type=int, default=0)
    # accepted as vLLM takes it, without effect: the sim stands for a pipeline across nodes in
    # one process
    p.add_argument("--distributed-executor-backend", default=None)
    p.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default="fcfs",
        help="waiting queue order: arrival, or the request's `priority` (lower first)",
    )
    p.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="POST /sleep, /wake_up, GET /is_sleeping (mounted with VLLM_SERVER_DEV_MODE=1)",
    )
    sim = p.add_argument_group("sim engine (flexpipe only)")
    sim.add_argument(
        "--weight-source",
        default=None,
        choices=KINDS,
        help="where weights load from (cold start, level-2 wake); default: storage at 2 GB/s",
    )
    sim.add_argument("--weight-source-gb-per-s", type=float, default=None, help="its bandwidth")
    sim.add_argument("--gpu-type", default="A100-80G-SXM", help="GPU type each rank stands for")
    sim.add_argument("--link", default="nvlink3", help="link between tensor-parallel ranks")
    sim.add_argument("--pp-link", default=None, help="link between pipeline stages")
    sim.add_argument("--cluster", default=None, help="cluster file (with --gpu-ids)")
    sim.add_argument("--gpu-ids", default=None, help="GPU ids from --cluster, stage by stage")
    sim.add_argument("--time-scale", type=float, default=1.0, help="0: no sleeping at all")
    sim.add_argument("--load-time-s", type=float, default=None, help="override the cold start")
    sim.add_argument("--admin-token", default=None, help="or env FLEXPIPE_ADMIN_TOKEN")
    sim.add_argument("--admin-token-file", default=None, help="read the admin token from a file")
    sim.add_argument("--max-request-body-bytes", type=int, default=16 * 1024 * 1024)
    sim.add_argument("--log-level", default="warning")
    return p


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: ModelSpec
    model_path: str
    served_model_names: tuple[str, ...]
    host: str
    port: int
    gear: Gear
    pm: PerfModel
    max_model_len: int
    num_kv_blocks: int  # the memory plan's, or --num-gpu-blocks-override
    enable_chunked_prefill: bool
    gpu_memory_utilization: float
    api_key: str | None
    admin_token: str | None
    seed: int
    time_scale: float
    load_time_s: float  # modelled (unscaled)
    max_request_body_bytes: int
    log_level: str
    ignored_flags: tuple[str, ...]
    hardware: str  # one line: what the sim stands for
    scheduling_policy: str = "fcfs"  # "fcfs" | "priority" (vLLM's --scheduling-policy)
    enable_sleep_mode: bool = False  # vLLM's --enable-sleep-mode
    server_dev_mode: bool = False  # VLLM_SERVER_DEV_MODE=1: the sleep endpoints are mounted
    weight_source: WeightSource | None = None  # None: the model's default (storage)

    @property
    def served_model_name(self) -> str:
        return self.served_model_names[0]


def _dtype(args: argparse.Namespace) -> str:
    """A flexpipe precision name from vLLM's --quantization / --dtype."""
    q = (args.quantization or "").lower().removesuffix("_marlin")
    if q in ("compressed-tensors", "smoothquant"):
        q = "int8"
    name = q if q else str(args.dtype).lower()
    return precision(name).name


def parse_engine_args(argv: Sequence[str]) -> EngineConfig:
    parser = build_parser()
    args, unknown = parser.parse_known_args(list(argv))
    ignored = tuple(a for a in unknown if a.startswith("-"))
    model_path = args.model or args.model_tag
    if not model_path:
        raise EngineArgsError("no model given: pass it as `MODEL` or `--model MODEL`")
    try:
        model = load_model_spec(model_path)
    except ValueError as exc:
        raise EngineArgsError(str(exc)) from None
    tp, pp = args.tensor_parallel_size, args.pipeline_parallel_size
    try:
        gear = Gear(
            tp=tp,
            pp=pp,
            dtype=_dtype(args),
            kv_cache_dtype=str(args.kv_cache_dtype).lower(),
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens or 8192,
            block_size=args.block_size,
            enable_prefix_caching=bool(args.enable_prefix_caching),
        )
        if args.cluster:
            pm, hardware = _cluster_perf_model(args, model, gear)
        else:
            slots = [GpuSlot.whole(args.gpu_type, f"gpu{i}") for i in range(gear.num_gpus)]
            placement = uniform_placement(
                slots,
                tp,
                pp,
                model.num_layers,
                link_spec(args.link),
                link_spec(args.pp_link or args.link),
                layer_partition(pp, model.num_layers),
            )
            pm = PerfModel(
                model, gear, placement, None, args.gpu_memory_utilization, args.max_model_len
            )
            hardware = f"{gear.num_gpus} x {args.gpu_type} over {args.link}"
        pm.require_feasible()
    except (ValueError, KeyError) as exc:
        msg = exc.args[0] if isinstance(exc, KeyError) and exc.args else str(exc)
        raise EngineArgsError(f"cannot run {model_path} with tp={tp}, pp={pp}: {msg}") from None
    max_model_len = pm.memory.max_model_len
    num_kv_blocks = args.num_gpu_blocks_override or pm.memory.num_kv_blocks
    if num_kv_blocks * gear.block_size < max_model_len:
        raise EngineArgsError(
            f"the KV cache holds {num_kv_blocks * gear.block_size} tokens, less than "
            f"max_model_len {max_model_len}: lower --max-model-len"
        )
    if args.max_num_batched_tokens is None and not args.enable_chunked_prefill:
        gear = replace(gear, max_num_batched_tokens=max(8192, max_model_len))
    source = _weight_source(args, pm)
    load_time_s = args.load_time_s
    if load_time_s is None:
        load_time_s = pm.cold_start_s(None, source)
    names = tuple(args.served_model_name or [model_path])
    admin = _secret(args.admin_token, args.admin_token_file, "FLEXPIPE_ADMIN_TOKEN", "admin-token")
    api_key = _secret(args.api_key, args.api_key_file, "VLLM_API_KEY", "api-key")
    if args.time_scale < 0:
        raise EngineArgsError("--time-scale must be >= 0")
    return EngineConfig(
        model=model,
        model_path=model_path,
        served_model_names=names,
        host=args.host,
        port=args.port,
        gear=gear,
        pm=pm,
        max_model_len=max_model_len,
        num_kv_blocks=num_kv_blocks,
        enable_chunked_prefill=bool(args.enable_chunked_prefill),
        scheduling_policy=str(args.scheduling_policy),
        gpu_memory_utilization=args.gpu_memory_utilization,
        api_key=api_key,
        admin_token=admin,
        seed=args.seed,
        time_scale=args.time_scale,
        load_time_s=load_time_s,
        max_request_body_bytes=args.max_request_body_bytes,
        log_level=args.log_level,
        ignored_flags=ignored,
        hardware=hardware,
        enable_sleep_mode=bool(args.enable_sleep_mode),
        server_dev_mode=_env_flag("VLLM_SERVER_DEV_MODE"),
        weight_source=source,
    )


def _env_flag(name: str) -> bool:
    """A 0/1 environment flag, read as vLLM reads its envs (`bool(int(...))`)."""
    try:
        return bool(int(os.environ.get(name, "0")))
    except ValueError:
        raise EngineArgsError(f"{name} must be 0 or 1") from None


def _weight_source(args: argparse.Namespace, pm: PerfModel) -> WeightSource | None:
    if args.weight_source is None:
        if args.weight_source_gb_per_s is not None:
            raise EngineArgsError("--weight-source-gb-per-s needs --weight-source")
        return None
    gb = args.weight_source_gb_per_s
    try:
        return source_of(
            args.weight_source,
            None if gb is None else gb * 1e9,
            link_spec(args.link),
            pm.efficiency.p2p_bandwidth_efficiency,
        )
    except ValueError as exc:
        raise EngineArgsError(str(exc)) from None


def _secret(value: str | None, path: str | None, env: str, flag: str) -> str | None:
    """A secret from --FLAG, --FLAG-file (first line, surrounding whitespace stripped) or the
    environment, in that order; giving both the flag and the file is an error."""
    if value is not None and path is not None:
        raise EngineArgsError(f"give --{flag} or --{flag}-file, not both")
    if path is not None:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.readline().strip()
        except (OSError, UnicodeDecodeError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
            raise EngineArgsError(f"--{flag}-file {path}: {reason}") from None
        if not text:
            raise EngineArgsError(f"--{flag}-file {path} is empty")
        return text
    return value or os.environ.get(env) or None


def _cluster_perf_model(
    args: argparse.Namespace, model: ModelSpec, gear: Gear
) -> tuple[PerfModel, str]:
    from flexpipe.cluster import load_cluster, placement_on

    if not args.gpu_ids:
        raise GearError("--cluster needs --gpu-ids (e.g. --gpu-ids gpu0,gpu1)")
    cluster = load_cluster(args.cluster)
    text = str(args.gpu_ids)
    if ";" in text:
        stages = [[g.strip() for g in s.split(",") if g.strip()] for s in text.split(";")]
    else:
        flat = [g.strip() for g in text.split(",") if g.strip()]
        if len(flat) != gear.num_gpus:
            raise GearError(
                f"--gpu-ids lists {len(flat)} GPUs; "
                f"tp={gear.tp} x pp={gear.pp} needs {gear.num_gpus}"
            )
        stages = [flat[i * gear.tp : (i + 1) * gear.tp] for i in range(gear.pp)]
    placement = placement_on(
        cluster, stages, model.num_layers, layer_partition(gear.pp, model.num_layers)
    )
    if placement.tp != gear.tp or placement.pp != gear.pp:
        raise GearError(
            f"--gpu-ids gives tp={placement.tp}, pp={placement.pp}; "
            f"flags say tp={gear.tp}, pp={gear.pp}"
        )
    pm = PerfModel(model, gear, placement, None, args.gpu_memory_utilization, args.max_model_len)
    return pm, f"{args.cluster}: {'; '.join(','.join(s) for s in stages)}"


def layer_partition(pp: int, num_layers: int) -> tuple[int, ...] | None:
    """Layers per pipeline stage from VLLM_PP_LAYER_PARTITION ("10,22"), as vLLM reads it:
    the planner's uneven splits over unequal GPUs reach the engine this way. None: even."""
    text = os.environ.get("VLLM_PP_LAYER_PARTITION", "").strip()
    if not text:
        return None
    try:
        layers = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise GearError(f"VLLM_PP_LAYER_PARTITION={text!r}: expected integers like 10,22") from None
    if len(layers) != pp or sum(layers) != num_layers or min(layers) < 1:
        raise GearError(
            f"VLLM_PP_LAYER_PARTITION={text!r} must give {pp} positive stage sizes "
            f"summing to the model's {num_layers} layers"
        )
    return layers


def warn_ignored(cfg: EngineConfig) -> None:
    for flag in cfg.ignored_flags:
        print(
            f"flexpipe sim engine: ignoring vLLM flag {flag} (no effect in the sim)",
            file=sys.stderr,
        )

"""What flexpipe launches, checked against the engines' own argument tables (recorded from
vLLM's and SGLang's real parsers for a pinned release: tests/data/README-engine-args.md):
every flag exists, takes a value exactly when flexpipe gives one, and every value is one the
engine accepts; every variable exists; the sim engine accepts all that vLLM gets; the
engine kinds' metric names are the engines' own."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest

from flexpipe.cluster import load_cluster
from flexpipe.control.engines.launching import engine_spec, gpu_memory_utilization
from flexpipe.engine.args import parse_engine_args
from flexpipe.engine_kinds import ENGINE_KINDS
from flexpipe.examples import DEFAULT_CLUSTER
from flexpipe.gears.gear import parse_gear
from flexpipe.hardware import GiB
from flexpipe.launch import EngineSpec, GpuPlace, LocalLauncher
from flexpipe.launch.command import EngineCommandError, engine_env, sglang_flags, vllm_flags
from flexpipe.policies.planner import parse_models, plan

DATA = Path(__file__).parents[1] / "data"


def _table(prefix: str) -> dict[str, Any]:
    """The newest recorded table of an engine (one file per release)."""
    (path,) = sorted(DATA.glob(f"{prefix}-*.json"))[-1:]
    doc: dict[str, Any] = json.loads(path.read_text())
    return doc


VLLM = _table("vllm_serve_args")
SGLANG = _table("sglang_launch_server_args")

_TWO_NODES = (
    GpuPlace("n0/gpu0", "n0", 0, "A100-80G-SXM"),
    GpuPlace("n1/gpu0", "n1", 0, "A100-80G-SXM"),
)
_INT4 = {"weights": "TheBloke/Llama-2-7B-AWQ", "quantization": "awq"}
_INT8 = {"weights": "org/llama-2-7b-w8a8", "quantization": "compressed-tensors"}

# every shape of command flexpipe emits: precisions from each kind of checkpoint, prefix
# caching off, fp8 KV, a context limit, sleep mode, an uneven pipeline across nodes
SPECS: dict[str, dict[str, Any]] = {
    "bf16-tp2": {"gear": "tp=2,max_num_seqs=64", "gpu_indices": (0, 1)},
    "fp8-dynamic": {"gear": "tp=1,dtype=fp8,kv=fp8", "max_model_len": 4096},
    "int4-awq": {"gear": "tp=1,dtype=int4", **_INT4},
    "int4-gptq": {
        "gear": "tp=1,dtype=int4-gptq",
        "weights": "TheBloke/Llama-2-7B-GPTQ",
        "quantization": "gptq",
    },
    "int8-w8a8": {"gear": "tp=1,dtype=int8,enable_prefix_caching=false", **_INT8},
    "fp16": {"gear": "tp=1,dtype=fp16,kv=fp8_e5m2"},
    "sleep": {"gear": "tp=1", "enable_sleep_mode": True},
    "pp-across-nodes": {
        "gear": "tp=1,pp=2",
        "placement": _TWO_NODES,
        "env": (("VLLM_PP_LAYER_PARTITION", "12,20"),),
    },
}


def _spec(name: str) -> EngineSpec:
    kw = dict(SPECS[name])
    gear = parse_gear(kw.pop("gear"))
    return EngineSpec(
        "llama-2-7b",
        gear,
        name=name,
        served_model_name="llama-7b",
        gpu_memory_utilization=0.85,
        **kw,
    )


def check_argv(table: dict[str, Any], argv: list[str], quantizations: list[str] | None) -> None:
    """Every token of `argv` is a positional the engine takes or one of its options with a
    value exactly where it wants one, and each value one it accepts."""
    options = table["options"]
    positional = [k for k, v in options.items() if v.get("positional")]
    i = 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("-"):
            assert positional, f"{token!r}: the engine takes no positional argument"
            positional.pop(0)
            i += 1
            continue
        assert token in options, f"{token}: not an option of {table['engine']} {table['version']}"
        entry = options[token]
        if entry["takes_value"] is False:
            i += 1
            continue
        assert entry["takes_value"] is True, token
        value = argv[i + 1]
        assert not value.startswith("--"), f"{token} needs a value"
        if entry["choices"] is not None:
            assert value in entry["choices"], f"{token} {value}: not in {entry['choices']}"
        if entry["known_values"] is not None:
            assert value in entry["known_values"], (
                f"{token} {value}: not in {entry['known_values']}"
            )
        if entry["dest"] == "quantization" and quantizations is not None:
            assert value in quantizations, f"--quantization {value}: not a method"
        i += 2


@pytest.mark.parametrize("name", sorted(SPECS))
def test_vllm_command_is_what_vllm_serve_accepts(name: str) -> None:
    argv, env = LocalLauncher("vllm").command(_spec(name), 8123)
    assert argv[:2] == ["vllm", "serve"]
    check_argv(VLLM, argv[2:], VLLM["quantization_methods"])
    ours = set(engine_env("vllm", _spec(name))) - {"CUDA_VISIBLE_DEVICES"}
    assert ours <= set(VLLM["env"]), ours - set(VLLM["env"])
    assert env.get("CUDA_VISIBLE_DEVICES") == ("0,1" if name == "bf16-tp2" else None)


@pytest.mark.parametrize("name", sorted(set(SPECS) - {"sleep", "pp-across-nodes"}))
def test_sglang_command_is_what_sglang_launch_server_accepts(name: str) -> None:
    argv, _ = LocalLauncher("sglang").command(_spec(name), 8123)
    assert argv[:3] == [sys.executable, "-m", "sglang.launch_server"]
    check_argv(SGLANG, argv[3:], None)


def test_the_check_fails_on_a_flag_or_value_the_engine_does_not_take() -> None:
    with pytest.raises(AssertionError, match="not an option"):
        check_argv(VLLM, ["m", "--tp-size", "2"], None)
    with pytest.raises(AssertionError, match="not a method"):
        check_argv(VLLM, ["m", "--quantization", "int8"], VLLM["quantization_methods"])
    with pytest.raises(AssertionError, match="not in"):
        check_argv(SGLANG, ["--kv-cache-dtype", "fp8"], None)


def test_vllm_command_exactly() -> None:
    s = _spec("pp-across-nodes")
    assert vllm_flags(s, "0.0.0.0", 9000, real=True) == [
        "meta-llama/Llama-2-7b-hf",
        "--host", "0.0.0.0", "--port", "9000",
        "--tensor-parallel-size", "1", "--pipeline-parallel-size", "2",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192", "--block-size", "16",
        "--kv-cache-dtype", "auto", "--gpu-memory-utilization", "0.85",
        "--enable-prefix-caching", "--scheduling-policy", "priority",
        "--dtype", "bfloat16", "--served-model-name", "llama-7b",
        "--distributed-executor-backend", "ray",
    ]  # fmt: skip
    int4 = vllm_flags(_spec("int4-awq"), "h", 1, real=True)
    assert int4[0] == "TheBloke/Llama-2-7B-AWQ"
    assert int4[int4.index("--quantization") + 1] == "awq"
    assert int4[int4.index("--dtype") + 1] == "float16"
    fp8 = vllm_flags(_spec("fp8-dynamic"), "h", 1, real=True)
    assert fp8[0] == "meta-llama/Llama-2-7b-hf"  # quantized from the bf16 weights as they load
    assert fp8[fp8.index("--quantization") + 1] == "fp8" and "--dtype" not in fp8
    sleep = vllm_flags(_spec("sleep"), "h", 1, real=True)
    assert "--enable-sleep-mode" in sleep
    assert engine_env("vllm", _spec("sleep"))["VLLM_SERVER_DEV_MODE"] == "1"


def test_sglang_command_exactly() -> None:
    assert sglang_flags(_spec("int8-w8a8"), "127.0.0.1", 30000) == [
        "--model-path", "org/llama-2-7b-w8a8",
        "--host", "127.0.0.1", "--port", "30000",
        "--tp-size", "1", "--pp-size", "1", "--max-running-requests", "256",
        "--chunked-prefill-size", "8192", "--page-size", "16", "--kv-cache-dtype", "auto",
        "--mem-fraction-static", "0.85",
        "--enable-priority-scheduling", "--schedule-low-priority-values-first",
        "--enable-metrics", "--disable-radix-cache",
        "--quantization", "compressed-tensors", "--served-model-name", "llama-7b",
    ]  # fmt: skip
    env = engine_env("sglang", EngineSpec("m", env=(("VLLM_PP_LAYER_PARTITION", "12,20"),)))
    assert env == {"SGLANG_PP_LAYER_PARTITION": "12,20"}


def test_what_an_engine_cannot_run_is_one_line_before_it_starts() -> None:
    bare_int4 = EngineSpec("llama-2-7b", parse_gear("tp=1,dtype=int4"), name="i")
    with pytest.raises(EngineCommandError, match="int4-awq needs a quantized checkpoint"):
        vllm_flags(bare_int4, "h", 1, real=True)
    with pytest.raises(EngineCommandError, match="pipeline spans nodes"):
        sglang_flags(_spec("pp-across-nodes"), "h", 1)
    int8_kv = EngineSpec("llama-2-7b", parse_gear("tp=1,kv=int8"), name="k")
    with pytest.raises(EngineCommandError, match="vllm has no KV cache dtype 'int8'"):
        vllm_flags(int8_kv, "h", 1, real=True)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_the_sim_engine_accepts_every_vllm_flag_flexpipe_emits(name: str) -> None:
    for real in (False, True):
        flags = vllm_flags(_spec(name), "127.0.0.1", 8123, real=real)
        if real and not flags[0].startswith("meta-llama/"):
            flags[0] = "llama-2-7b"  # (the sim knows shapes, not quantized checkpoints)
        cfg = parse_engine_args([*flags, "--time-scale", "0", "--gpu-type", "H100-80G-SXM"])
        assert cfg.ignored_flags == (), cfg.ignored_flags
        assert cfg.gear.dtype == _spec(name).gear.dtype


def test_engine_kinds_metric_names_are_the_engines_own() -> None:
    for kind, table in (("vllm", VLLM), ("sglang", SGLANG)):
        recorded = set(table["metrics"])
        for name in ENGINE_KINDS[kind].metrics:
            assert name in recorded or name.removesuffix("_total") in recorded, (kind, name)


def test_gpu_memory_utilization_leaves_other_tenants_their_memory() -> None:
    cluster = load_cluster(DEFAULT_CLUSTER)  # gpu1: 40 of its 80 GiB held by another tenant
    assert gpu_memory_utilization(cluster, ["gpu2"]) == 0.9
    assert gpu_memory_utilization(cluster, ["gpu1"]) == 0.5
    assert gpu_memory_utilization(cluster, ["gpu1", "gpu2"]) == 0.5  # the tightest GPU
    assert gpu_memory_utilization(cluster.with_used("gpu1", 30 * GiB), ["gpu1"]) == 0.625


def test_engine_spec_loads_the_checkpoint_the_models_file_names() -> None:
    cluster = load_cluster(DEFAULT_CLUSTER)
    demands = parse_models(
        {
            "models": [
                {
                    "name": "llama-7b",
                    "model": "llama-2-7b",
                    "demand": {"request_rate_per_s": 1, "input_tokens": 512, "output_tokens": 64},
                    "slo": {"ttft_p99_ms": 5000, "tpot_p99_ms": 200},
                    "dtypes": ["int4"],
                    "checkpoints": {
                        "int4": {"path": "TheBloke/Llama-2-7B-GPTQ", "quantization": "gptq"}
                    },
                }
            ]
        }
    )
    instances = plan(cluster, demands).instances
    assert instances
    for inst in instances:
        s = engine_spec(inst, cluster, str(DEFAULT_CLUSTER), demands)
        assert s.gear.dtype == "int4-gptq"
        assert (s.model, s.weights, s.quantization) == (
            "llama-2-7b",
            "TheBloke/Llama-2-7B-GPTQ",
            "gptq",
        )
        assert s.gpu_memory_utilization == gpu_memory_utilization(cluster, inst.gpu_ids)
        argv, _ = LocalLauncher("vllm").command(s, 8000)
        check_argv(VLLM, argv[2:], VLLM["quantization_methods"])

"""A restarted controller brings a shared engine back with its memory fraction
(docs/gpu-sharing.md): the engine says on /metrics what `--gpu-memory-utilization` it runs with
(vllm:cache_config_info's labels, as vLLM's CacheConfig.metrics_info gives them), and a
survivor whose fraction is below what an engine alone there gets is a shared one."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import cast

from flexpipe.cluster import parse_cluster_yaml
from flexpipe.control.engines.adopt import memory_fractions, reported_fraction
from flexpipe.control.engines.takeover import shared_fraction, stub
from flexpipe.engine.testing import sim_engine
from flexpipe.launch import EngineHandle, free_port
from flexpipe.lifecycle import State
from flexpipe.policies.planner import ModelDemand, Slo, plan
from flexpipe.store.instance_registry import InstanceRecord

# one line of a real vLLM's /metrics (labels: CacheConfig's fields, in its order)
VLLM_LINE = (
    'vllm:cache_config_info{block_size="16",cache_dtype="auto",calculate_kv_scales="False",'
    'cpu_offload_gb="0",enable_prefix_caching="True",gpu_memory_utilization="0.45",'
    'is_attention_free="False",num_gpu_blocks="27000",engine="0"} 1.0\n'
)


@dataclass
class _Handle:
    endpoint: str


def test_the_fraction_is_read_from_vllm_cache_config_info() -> None:
    text = "# HELP vllm:cache_config_info Information of the LLMEngine for CacheConfig\n"
    assert reported_fraction(text + VLLM_LINE) == 0.45
    assert reported_fraction(text) is None
    assert reported_fraction(VLLM_LINE.replace('"0.45"', '"x"')) is None


def test_a_sim_engine_reports_the_fraction_it_was_launched_with() -> None:
    args = ["llama-3.1-8b", "--gpu-memory-utilization", "0.3", "--time-scale", "0"]
    with sim_engine([*args, "--load-time-s", "0"]) as eng:
        dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: left out
        handles = cast(dict[int, EngineHandle], {7: _Handle(eng.url), 8: _Handle(dead)})
        assert asyncio.run(memory_fractions(handles)) == {7: 0.3}


def test_a_survivor_below_what_it_gets_alone_shares_its_gpu() -> None:
    assert shared_fraction(0.3, 0.9, ("g0",)) == 0.3
    assert shared_fraction(0.9, 0.9, ("g0",)) is None  # alone on its GPU
    assert shared_fraction(0.8996, 0.9, ("g0",)) is None  # rounding, not a share
    assert shared_fraction(0.3, 0.9, ("g0", "g1")) is None  # only single-GPU instances share
    assert shared_fraction(None, 0.9, ("g0",)) is None  # an engine that does not say


def test_the_stub_of_a_survivor_carries_its_fraction_and_only_its_own() -> None:
    one = "name: one\nnodes:\n  - name: n0\n    gpus: [{id: g0, type: A100-80G-SXM}]\n"
    demand = ModelDemand("m", "llama-3.1-8b", 0.3, 1024, 200, Slo(2.5, 0.08))
    (planned,) = plan(parse_cluster_yaml(one), [demand]).instances
    at = datetime(2026, 12, 1, tzinfo=UTC)
    record = InstanceRecord(1, "m-0", "m", str(planned.gear), ("g0",), "http://x", "sim",
                            State.ACTIVE, at, at, None, None, None, None, None, None)  # fmt: skip
    shared = stub(record, [planned], 0.3)
    assert shared is not None and shared.gpu_memory_fraction == 0.3
    # (a template's fraction is not the survivor's)
    alone = stub(record, [replace(planned, gpu_memory_fraction=0.5)])
    assert alone is not None and alone.gpu_memory_fraction is None

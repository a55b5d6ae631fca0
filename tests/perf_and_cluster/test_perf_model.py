"""The performance model: physics as properties, and public reference points."""

from __future__ import annotations

import pytest

from flexpipe.gears.gear import GpuSlot, parse_gear, uniform_placement
from flexpipe.hardware import link_spec
from flexpipe.model_spec import load_model_spec
from flexpipe.perf import (
    BatchShape,
    Efficiency,
    InfeasibleGear,
    PerfModel,
    allreduce_s,
    perf_model_for,
)

GiB = float(2**30)


# -- physics -------------------------------------------------------------------------------


def test_decode_time_rises_with_batch_and_context() -> None:
    pm = perf_model_for("llama-2-7b")
    by_batch = [pm.decode_step_s(b, 512) for b in (1, 8, 32, 128)]
    assert by_batch == sorted(by_batch) and by_batch[0] < by_batch[-1]
    by_context = [pm.decode_step_s(16, c) for c in (128, 1024, 4096)]
    assert by_context == sorted(by_context) and by_context[0] < by_context[-1]


def test_allreduce_cost_follows_link_bandwidth() -> None:
    message = 64 * 2**20  # large enough that latency does not matter
    nvlink = allreduce_s(message, 2, link_spec("nvlink3"))
    for slow in ("pcie4", "eth25", "ib200"):
        ratio = allreduce_s(message, 2, link_spec(slow)) / nvlink
        bandwidth_ratio = (
            link_spec("nvlink3").bandwidth_bytes_per_s / link_spec(slow).bandwidth_bytes_per_s
        )
        assert ratio == pytest.approx(bandwidth_ratio, rel=0.05), slow


def test_allreduce_is_free_for_one_rank_and_grows_with_ranks() -> None:
    link = link_spec("nvlink3")
    assert allreduce_s(1e6, 1, link) == 0.0
    assert allreduce_s(1e6, 2, link) < allreduce_s(1e6, 4, link) < allreduce_s(1e6, 8, link)


def test_tp2_over_nvlink_lowers_13b_decode_step() -> None:
    tp1 = perf_model_for("llama-2-13b", "tp=1")
    tp2 = perf_model_for("llama-2-13b", "tp=2", link="nvlink3")
    for batch in (1, 8, 32):
        assert tp2.decode_step_s(batch, 512) < 0.75 * tp1.decode_step_s(batch, 512)


def test_tp2_over_25gbe_is_slower_than_nvlink_by_more_as_batch_grows() -> None:
    nvlink = perf_model_for("llama-2-13b", "tp=2", link="nvlink3")
    eth = perf_model_for("llama-2-13b", "tp=2", link="eth25")
    gaps = [eth.decode_step_s(b, 512) - nvlink.decode_step_s(b, 512) for b in (1, 8, 32, 128)]
    assert all(g > 0 for g in gaps)
    assert gaps == sorted(gaps) and gaps[-1] > 3 * gaps[0]


def test_llama2_70b_bf16_needs_two_80gb_gpus() -> None:
    one = perf_model_for("llama-2-70b", "tp=1")
    assert not one.feasible
    assert one.reason is not None and "GiB per GPU" in one.reason and "gpu0 has" in one.reason
    with pytest.raises(InfeasibleGear):
        one.require_feasible()
    two = perf_model_for("llama-2-70b", "tp=2")
    assert two.feasible
    # Room for KV: ~5.8 GiB a GPU after 64 GiB of weights, over 30k tokens (vLLM reports
    # ~36k for this setup): at least 32 sequences of 1k tokens.
    assert two.memory.kv_capacity_tokens > 30_000
    assert two.memory.max_batch(1024) >= 32


def test_int4_weights_shorten_decode() -> None:
    bf16 = perf_model_for("llama-2-7b", "dtype=bf16")
    int4 = perf_model_for("llama-2-7b", "dtype=int4")
    assert int4.decode_step_s(1, 512) < 0.5 * bf16.decode_step_s(1, 512)
    assert int4.memory.kv_capacity_tokens > bf16.memory.kv_capacity_tokens


def test_pipeline_over_a100_and_v100_is_paced_by_v100() -> None:
    spec = load_model_spec("llama-2-7b")
    gear = parse_gear("tp=1,pp=2,dtype=fp16")
    slots = [GpuSlot.whole("A100-80G-SXM", "a100"), GpuSlot.whole("V100-32G", "v100")]
    placement = uniform_placement(slots, 1, 2, spec.num_layers, None, link_spec("pcie4"))
    pm = PerfModel(spec, gear, placement)
    stages = pm.stage_times_s(BatchShape(num_decode_seqs=8, decode_context_tokens=8 * 512))
    assert stages[1] > 1.5 * stages[0]  # the V100 stage is the slow one
    a100_only = perf_model_for("llama-2-7b", "tp=1,pp=2,dtype=fp16", link="pcie4")
    assert pm.decode_interval_s(8, 512) > 1.5 * a100_only.decode_interval_s(8, 512)
    # The slowest stage paces the pipeline: interval = pp x slowest stage (+ overheads).
    assert pm.decode_interval_s(8, 512) >= 2 * max(
        pm.stage_times_s(BatchShape(num_decode_seqs=4, decode_context_tokens=4 * 512))
    )


def test_bf16_on_v100_is_refused_with_a_reason() -> None:
    pm = perf_model_for("llama-2-7b", "dtype=bf16", gpu_type="V100-32G")
    assert not pm.feasible
    assert pm.reason is not None and "bf16" in pm.reason


def test_chunked_prefill_mix_costs_more_than_either_part() -> None:
    pm = perf_model_for("llama-2-7b")
    decode = BatchShape.of(decode_contexts=[512] * 32)
    prefill = BatchShape.of(prefills=[(512, 0)])
    mixed = BatchShape.of(prefills=[(512, 0)], decode_contexts=[512] * 32)
    assert pm.step_time_s(mixed) > max(pm.step_time_s(decode), pm.step_time_s(prefill))
    # A chunk over cached context costs more than the same chunk over none.
    assert pm.prefill_s(1024, cached_tokens=512) < pm.prefill_s(1024)
    assert pm.step_time_s(BatchShape.of(prefills=[(512, 1536)])) > pm.step_time_s(prefill)
    assert pm.step_time_s(BatchShape()) == 0.0


def test_moe_decode_reads_only_active_experts_at_batch_one() -> None:
    pm = perf_model_for("mixtral-8x7b", "tp=2")
    dense_equivalent = perf_model_for("llama-2-13b", "tp=2")
    # Mixtral touches ~13B parameters per token: about a 13B dense model's step at batch 1.
    assert pm.decode_step_s(1, 512) == pytest.approx(
        dense_equivalent.decode_step_s(1, 512), rel=0.3
    )
    # At large batch every expert is read: the step grows towards the full 47B.
    assert pm.decode_step_s(64, 512) > 2 * pm.decode_step_s(1, 512)


def test_memory_plan_splits_weights_and_kv() -> None:
    tp1 = perf_model_for("llama-2-7b", "tp=1").memory
    tp2 = perf_model_for("llama-2-7b", "tp=2").memory
    assert tp2.per_gpu[0].weights_bytes == pytest.approx(tp1.per_gpu[0].weights_bytes / 2, rel=0.01)
    assert tp2.per_gpu[0].kv_bytes_per_token == tp1.per_gpu[0].kv_bytes_per_token / 2
    # Llama-2-7B: 32 layers x 2 (K, V) x 4096 x 2 bytes = 512 KiB per token.
    assert tp1.kv_bytes_per_token == 32 * 2 * 4096 * 2
    assert tp1.num_kv_blocks * 16 == tp1.kv_capacity_tokens
    pp2 = perf_model_for("llama-2-7b", "tp=1,pp=2", link="pcie4").memory
    assert pp2.per_gpu[0].kv_bytes_per_token == tp1.per_gpu[0].kv_bytes_per_token / 2


def test_kv_heads_are_replicated_beyond_their_count() -> None:
    # Llama-2-70B has 8 KV heads: TP16 cannot split them further.
    tp8 = perf_model_for("llama-2-70b", "tp=8").memory
    tp16 = perf_model_for("llama-2-70b", "tp=16", link="nvswitch-h100", gpu_type="H100-80G-SXM")
    assert tp16.memory.per_gpu[0].kv_bytes_per_token == tp8.per_gpu[0].kv_bytes_per_token


def test_a_partly_used_gpu_gets_less_kv_and_the_reason_names_it() -> None:
    spec = load_model_spec("llama-2-13b")
    gear = parse_gear("tp=1")
    full = GpuSlot.whole("A100-40G-SXM", "gpu0")
    half = GpuSlot("gpu1", full.spec, full.spec.memory_bytes / 2)
    assert PerfModel(spec, gear, uniform_placement([full], 1, 1, spec.num_layers)).feasible
    pm = PerfModel(spec, gear, uniform_placement([half], 1, 1, spec.num_layers))
    assert not pm.feasible
    assert pm.reason is not None and "gpu1 has 20.0 GiB free" in pm.reason


def test_cold_start_scales_with_weights_and_storage_bandwidth() -> None:
    small = perf_model_for("llama-2-7b")
    big = perf_model_for("llama-2-70b", "tp=4")
    assert big.cold_start_s() > small.cold_start_s()
    assert small.cold_start_s(1e9) > small.cold_start_s(4e9)
    eff = Efficiency(engine_startup_s=5.0)
    fast = perf_model_for("llama-2-7b", efficiency=eff)
    assert fast.cold_start_s() == pytest.approx(small.cold_start_s() - 15.0)


def test_kv_transfer_cost_follows_bandwidth() -> None:
    pm = perf_model_for("llama-2-7b")
    nvlink = pm.kv_transfer_s(1000, link_spec("nvlink3").bandwidth_bytes_per_s)
    eth = pm.kv_transfer_s(1000, link_spec("eth25").bandwidth_bytes_per_s)
    assert eth / nvlink == pytest.approx(300 / 3.125, rel=0.01)


def test_efficiency_overrides_are_validated() -> None:
    eff = Efficiency.from_mapping({"hbm_efficiency": "0.5"})
    assert eff.hbm_efficiency == 0.5
    slow = perf_model_for("llama-2-7b", efficiency=eff)
    assert slow.decode_step_s(1, 128) > perf_model_for("llama-2-7b").decode_step_s(1, 128)
    with pytest.raises(ValueError, match="unknown efficiency factor"):
        Efficiency.from_mapping({"hbm_eficiency": 0.5})
    with pytest.raises(ValueError, match="out of range"):
        Efficiency.from_mapping({"hbm_efficiency": 1.5})


# -- reference points (public measurements of vLLM-class engines) ---------------------------


def test_reference_llama2_7b_single_stream_decode_on_a100() -> None:
    # vLLM / TGI single-stream Llama-2-7B fp16 on one A100-80GB: ~8-11 ms per token
    # (Anyscale "Continuous batching" benchmarks, 2023; NVIDIA TensorRT-LLM perf overview
    # reports ~7 ms at batch 1). Accept 6-12 ms.
    pm = perf_model_for("llama-2-7b", "tp=1,dtype=bf16", gpu_type="A100-80G-SXM")
    assert 6e-3 <= pm.decode_step_s(1, 512) <= 12e-3


def test_reference_llama2_70b_tp4_single_stream_decode_on_a100() -> None:
    # Llama-2-70B fp16, TP4 on A100-80GB SXM (NVLink): ~20-30 ms per token in vLLM
    # (vLLM v0.2 benchmarks; Databricks "LLM inference performance engineering", 2023:
    # 70B on 4xA100 ~ 25 ms/token at batch 1). Accept 15-40 ms.
    pm = perf_model_for("llama-2-70b", "tp=4,dtype=bf16", link="nvlink3")
    assert 15e-3 <= pm.decode_step_s(1, 512) <= 40e-3


def test_reference_llama2_7b_prefill_2048_on_a100() -> None:
    # Prefill of 2,048 tokens, Llama-2-7B on one A100-80GB: ~28 TFLOP at 50-65% MFU =
    # 140-180 ms (Databricks 2023; vLLM benchmark_latency TTFT). Accept 100-250 ms.
    pm = perf_model_for("llama-2-7b", "tp=1,dtype=bf16")
    assert 0.100 <= pm.prefill_s(2048) <= 0.250


def test_step_time_is_cheap_to_evaluate() -> None:
    # The sim engine calls step_time_s every iteration: it must not depend on batch size.
    pm = perf_model_for("llama-2-7b")
    shape = BatchShape(num_decode_seqs=256, decode_context_tokens=256 * 1000)
    assert pm.step_time_s(shape) > 0

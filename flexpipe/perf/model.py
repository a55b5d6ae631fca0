"""`PerfModel`: a model's gear on a placement, with its memory plan and step-time function.

Everything shape- and hardware-dependent is folded into per-stage constants once, so that
`step_time_s` is a handful of multiplications: the sim engine calls it every iteration and
the planner thousands of times.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.gears.gear import Gear, GpuSlot, Placement, parse_gear, uniform_placement
from flexpipe.hardware import GpuSpec, LinkSpec, link_spec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from flexpipe.perf.memory import InfeasibleGear, MemoryPlan, kv_heads_per_gpu, memory_plan
from flexpipe.perf.step_time import BatchShape, allreduce_s, p2p_s, roofline_s
from flexpipe.precision import (
    PRECISIONS,
    PrecisionError,
    compute_flops_per_s,
    kv_bytes_per_element,
)


@dataclass(frozen=True, slots=True)
class _StageCost:
    """Per-stage constants of the roofline (bytes and FLOPs per GPU)."""

    num_layers: int
    hbm_bytes_per_s: float
    linear_flops_per_s: float
    attention_flops_per_s: float
    dense_weight_bytes_per_layer: float  # attention + router (+ all of a dense MLP)
    expert_bytes: float  # one expert's weights per GPU (MoE only)
    linear_flops_per_token_per_layer: float
    attention_flops_per_pair_per_layer: float
    kv_bytes_per_token_per_layer: float
    tp: int
    tp_link: LinkSpec | None
    lm_head_bytes: float  # last stage only, else 0
    lm_head_flops_per_seq: float


def _slowest_gpu(gpus: tuple[GpuSlot, ...]) -> GpuSpec:
    return min((g.spec for g in gpus), key=lambda s: s.hbm_bandwidth_bytes_per_s)


class PerfModel:
    """The performance model of one gear on one placement. Pure: no clock, no I/O."""

    def __init__(
        self,
        model: ModelSpec,
        gear: Gear,
        placement: Placement,
        efficiency: Efficiency | None = None,
        gpu_memory_utilization: float = 0.9,
        max_model_len: int | None = None,
    ) -> None:
        self.model = model
        self.gear = gear
        self.placement = placement
        self.efficiency = eff = efficiency or DEFAULT_EFFICIENCY
        self.memory: MemoryPlan = memory_plan(
            model, gear, placement, eff, gpu_memory_utilization, max_model_len
        )
        prec = gear.precision
        self._unsupported: str | None = None
        self._stages: list[_StageCost] = []
        for i, stage in enumerate(placement.stages):
            gpu = _slowest_gpu(stage.gpus)
            try:
                self._stages.append(self._stage_cost(gpu, stage.num_layers, stage.tp_link, i))
            except PrecisionError as exc:
                self._unsupported = str(exc)
                break
        self._handoff_bytes_per_token = model.hidden_size * prec.activation_bytes
        self._pp_links = placement.pp_links

    def _stage_cost(
        self, gpu: GpuSpec, num_layers: int, tp_link: LinkSpec | None, index: int
    ) -> _StageCost:
        model, gear, eff = self.model, self.gear, self.efficiency
        prec = gear.precision
        tp = gear.tp
        hbm = gpu.hbm_bandwidth_bytes_per_s * eff.hbm_efficiency
        linear_rate = compute_flops_per_s(gpu, prec) * eff.compute_efficiency
        # Attention runs in 16 bit whatever the weight format (bf16 where the chip has it).
        attn_prec = PRECISIONS["bf16" if gpu.bf16_flops_per_s is not None else "fp16"]
        attention_rate = compute_flops_per_s(gpu, attn_prec) * eff.attention_compute_efficiency
        router = model.hidden_size * model.num_experts if model.is_moe else 0
        dense_params = model.attention_params_per_layer + router
        if not model.is_moe:
            dense_params += model.mlp_params_per_expert
        active_params = (
            model.attention_params_per_layer
            + router
            + model.num_experts_per_tok * model.mlp_params_per_expert
        )
        kv_elem = kv_bytes_per_element(gear.kv_cache_dtype, prec)
        is_last = index == self.placement.pp - 1
        embed_bytes = max(prec.weight_bytes, prec.activation_bytes)
        lm_params = model.vocab_size * model.hidden_size / tp
        return _StageCost(
            num_layers=num_layers,
            hbm_bytes_per_s=hbm,
            linear_flops_per_s=linear_rate,
            attention_flops_per_s=attention_rate,
            dense_weight_bytes_per_layer=dense_params * prec.weight_bytes / tp,
            expert_bytes=model.mlp_params_per_expert * prec.weight_bytes / tp,
            linear_flops_per_token_per_layer=2.0 * active_params / tp,
            # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, q_size wide.
            attention_flops_per_pair_per_layer=4.0 * model.q_size / tp,
            kv_bytes_per_token_per_layer=2 * kv_heads_per_gpu(model, tp) * model.head_dim * kv_elem,
            tp=tp,
            tp_link=tp_link,
            lm_head_bytes=lm_params * embed_bytes if is_last else 0.0,
            lm_head_flops_per_seq=2.0 * lm_params if is_last else 0.0,
        )

    # -- feasibility -------------------------------------------------------------------

    @property
    def feasible(self) -> bool:
        return self.memory.feasible and self._unsupported is None

    @property
    def reason(self) -> str | None:
        return self._unsupported or self.memory.reason

    def require_feasible(self) -> None:
        if not self.feasible:
            raise InfeasibleGear(self.reason or "infeasible")

    # -- time ----------------------------------------------------------------------------

    def _experts_touched(self, num_tokens: int) -> float:
        """Expected distinct experts a batch routes to (uniform top-k routing)."""
        m = self.model
        if not m.is_moe:
            return 0.0
        miss = (1.0 - m.num_experts_per_tok / m.num_experts) ** num_tokens
        return m.num_experts * (1.0 - miss)

    def _stage_time_s(self, st: _StageCost, batch: BatchShape) -> float:
        eff = self.efficiency
        num_tokens = batch.num_tokens
        weight_bytes = st.num_layers * (
            st.dense_weight_bytes_per_layer + self._experts_touched(num_tokens) * st.expert_bytes
        )
        linear = roofline_s(
            weight_bytes,
            st.num_layers * st.linear_flops_per_token_per_layer * num_tokens,
            st.hbm_bytes_per_s,
            st.linear_flops_per_s,
        )
        kv_tokens = batch.decode_context_tokens + batch.num_prefill_tokens
        pairs = batch.prefill_attention_tokens + batch.decode_context_tokens
        attention = roofline_s(
            st.num_layers * st.kv_bytes_per_token_per_layer * kv_tokens,
            st.num_layers * st.attention_flops_per_pair_per_layer * pairs,
            st.hbm_bytes_per_s,
            st.attention_flops_per_s,
        )
        comm = 0.0
        if st.tp > 1 and st.tp_link is not None:
            message = num_tokens * self._handoff_bytes_per_token
            per_allreduce = allreduce_s(
                message, st.tp, st.tp_link, eff.allreduce_bandwidth_efficiency
            )
            comm = 2 * st.num_layers * per_allreduce
        lm_head = 0.0
        if st.lm_head_bytes:
            lm_head = roofline_s(
                st.lm_head_bytes,
                st.lm_head_flops_per_seq * batch.num_seqs,
                st.hbm_bytes_per_s,
                st.linear_flops_per_s,
            )
        return linear + attention + comm + lm_head

    def stage_times_s(self, batch: BatchShape) -> list[float]:
        self._check_runnable()
        return [self._stage_time_s(st, batch) for st in self._stages]

    def handoff_s(self, batch: BatchShape, link: LinkSpec) -> float:
        """Sending one stage's hidden states for `batch` to the next stage over `link`."""
        message = batch.num_tokens * self._handoff_bytes_per_token
        return p2p_s(message, link, self.efficiency.p2p_bandwidth_efficiency)

    def _handoffs_s(self, batch: BatchShape) -> float:
        return sum(self.handoff_s(batch, link) for link in self._pp_links)

    def _overhead_s(self, batch: BatchShape) -> float:
        eff = self.efficiency
        return eff.step_overhead_s + eff.per_seq_overhead_s * batch.num_seqs

    def step_time_s(self, batch: BatchShape) -> float:
        """Wall time of one iteration through every stage (latency of the batch)."""
        if batch.is_empty:
            return 0.0
        self._check_runnable()
        stages = sum(self._stage_time_s(st, batch) for st in self._stages)
        return stages + self._handoffs_s(batch) + self._overhead_s(batch)

    def decode_step_s(self, batch_size: int, context_len: int) -> float:
        return self.step_time_s(
            BatchShape(num_decode_seqs=batch_size, decode_context_tokens=batch_size * context_len)
        )

    def prefill_s(self, prompt_tokens: int, cached_tokens: int = 0) -> float:
        new = prompt_tokens - cached_tokens
        return self.step_time_s(BatchShape.of(prefills=[(new, cached_tokens)]))

    def decode_interval_s(self, batch_size: int, context_len: int) -> float:
        """Steady-state time between two tokens of one sequence when the batch is split into
        pp micro-batches that overlap in the pipeline: the slowest stage paces it."""
        pp = self.placement.pp
        if pp == 1:
            return self.decode_step_s(batch_size, context_len)
        micro = max(1, -(-batch_size // pp))
        shape = BatchShape(num_decode_seqs=micro, decode_context_tokens=micro * context_len)
        slowest = max(self.stage_times_s(shape)) + self._handoffs_s(shape) / (pp - 1)
        return pp * (slowest + self._overhead_s(shape))

    def decode_tokens_per_s(self, batch_size: int, context_len: int) -> float:
        return batch_size / self.decode_interval_s(batch_size, context_len)

    def cold_start_s(self, storage_bandwidth_bytes_per_s: float | None = None) -> float:
        """Read every weight once from storage, plus engine start-up."""
        bandwidth = storage_bandwidth_bytes_per_s or self.efficiency.storage_bandwidth_bytes_per_s
        return self.memory.weights_bytes / bandwidth + self.efficiency.engine_startup_s

    def kv_transfer_s(
        self, num_tokens: int, bandwidth_bytes_per_s: float, latency_s: float = 0.0
    ) -> float:
        """Moving `num_tokens` tokens of KV cache between instances over a link."""
        eff = self.efficiency.p2p_bandwidth_efficiency
        return latency_s + num_tokens * self.memory.kv_bytes_per_token / (
            bandwidth_bytes_per_s * eff
        )

    def _check_runnable(self) -> None:
        if self._unsupported is not None:
            raise InfeasibleGear(self._unsupported)


def perf_model_for(
    model: str | ModelSpec,
    gear: Gear | str = "tp=1",
    gpu_type: str = "A100-80G-SXM",
    link: str = "nvlink3",
    pp_link: str | None = None,
    efficiency: Efficiency | None = None,
    gpu_memory_utilization: float = 0.9,
    max_model_len: int | None = None,
) -> PerfModel:
    """Convenience: `tp x pp` identical whole GPUs of `gpu_type` joined by `link`."""
    spec = load_model_spec(model) if isinstance(model, str) else model
    g = parse_gear(gear) if isinstance(gear, str) else gear
    slots = [GpuSlot.whole(gpu_type, f"gpu{i}") for i in range(g.num_gpus)]
    placement = uniform_placement(
        slots, g.tp, g.pp, spec.num_layers, link_spec(link), link_spec(pp_link or link)
    )
    return PerfModel(spec, g, placement, efficiency, gpu_memory_utilization, max_model_len)

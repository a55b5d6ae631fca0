"""`PerfModel`: a model's gear on a placement, with its memory plan and step-time function.

Everything shape- and hardware-dependent is folded into per-stage constants once, so that
`step_time_s` is a handful of multiplications: the sim engine calls it every iteration and
the planner thousands of times.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from flexpipe.gears.gear import (
    DEFAULT_GPU_MEMORY_UTILIZATION,
    Gear,
    GpuSlot,
    Placement,
    parse_gear,
    uniform_placement,
)
from flexpipe.hardware import GpuSpec, LinkSpec, gpu_spec, link_spec
from flexpipe.model_spec import ModelSpec, load_model_spec
from flexpipe.perf import weights
from flexpipe.perf.efficiency import DEFAULT_EFFICIENCY, Efficiency
from flexpipe.perf.memory import InfeasibleGear, MemoryPlan, kv_heads_per_gpu, memory_plan
from flexpipe.perf.operator import LayerShape, OperatorCost
from flexpipe.perf.step_time import BatchShape, LinkCost, roofline_s
from flexpipe.perf.weights import GpuShard, WeightSource
from flexpipe.precision import (
    PRECISIONS,
    PrecisionError,
    compute_flops_per_s,
    kv_bytes_per_element,
)


@dataclass(frozen=True, slots=True)
class _StageCost:
    """Per-stage constants (per GPU of the stage), so a step is a handful of multiplications."""

    num_layers: int
    ops: OperatorCost  # GEMMs and memory-bound ops on this stage's (slowest) GPU type
    hbm_bytes_per_s: float  # attention: generic factors (no attention profiles yet)
    attention_flops_per_s: float
    # One layer's dense GEMMs: (weight bytes, in_features, out_features) per GPU.
    gemms: tuple[tuple[float, int, int], ...]
    # MoE: one expert's GEMMs, the same way (empty for a dense model).
    expert_gemms: tuple[tuple[float, int, int], ...]
    memory_ops: tuple[tuple[str, int], ...]  # (op, elements per token) per layer
    activation_bytes: float
    # Generic factors price a layer's linear part as ONE roofline over its weights (they are
    # end-to-end figures: MBU/MFU of whole engines, elementwise ops included).
    layer_weight_bytes: float  # attention + router (+ a dense MLP)
    expert_weight_bytes: float  # one expert (MoE only)
    layer_flops_per_token: float  # active parameters x 2
    attention_flops_per_pair_per_layer: float
    kv_bytes_per_token_per_layer: float
    tp: int
    tp_link: LinkCost | None
    lm_head: tuple[float, int, int] | None  # last stage only


# token counts remembered per model: every batch size of a sim engine (up to
# max_num_batched_tokens, 8192 by default, per stage) so that its steps never miss (a few MB
# at most; a planner prices far fewer). At 4,096 the memo was cleared and refilled every few
# thousand steps of a sim engine.
_MAX_MEMO = 1 << 15


def _shape(batch: BatchShape) -> tuple[int, int, float]:
    """(tokens computed, tokens whose KV attention reads, query-key pairs) of `batch`."""
    return (
        batch.num_tokens,
        batch.decode_context_tokens + batch.num_prefill_tokens,
        batch.prefill_attention_tokens + batch.decode_context_tokens,
    )


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
        gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
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
        self._kernels_memo: dict[tuple[int, int], float] = {}
        self._stages: list[_StageCost] = []
        for i, stage in enumerate(placement.stages):
            gpu = _slowest_gpu(stage.gpus)
            try:
                self._stages.append(self._stage_cost(gpu, stage.num_layers, stage.tp_link, i))
            except PrecisionError as exc:
                self._unsupported = str(exc)
                break
        self._handoff_bytes_per_token = model.hidden_size * prec.activation_bytes
        self._pp_links = [self._link_cost(link) for link in placement.pp_links]

    def _stage_cost(
        self, gpu: GpuSpec, num_layers: int, tp_link: LinkSpec | None, index: int
    ) -> _StageCost:
        model, gear, eff = self.model, self.gear, self.efficiency
        prec = gear.precision
        tp = gear.tp
        # Attention runs in 16 bit whatever the weight format (bf16 where the chip has it).
        attn_prec = PRECISIONS["bf16" if gpu.bf16_flops_per_s is not None else "fp16"]
        attention_rate = compute_flops_per_s(gpu, attn_prec) * eff.attention_compute_efficiency
        ops = OperatorCost(
            gpu.hbm_bandwidth_bytes_per_s,
            compute_flops_per_s(gpu, prec),
            eff.hbm_efficiency,
            eff.compute_efficiency,
            eff.calibration.gpu(gpu.name),
        )
        dims = LayerShape.of(model).gemm_dims(tp)
        w = prec.weight_bytes

        def gemm(op: str) -> tuple[float, int, int]:
            k, n = dims[op]
            return (k * n * w, k, n)

        attention_gemms = (gemm("attn_pre_proj"), gemm("attn_post_proj"))
        mlp_gemms = (gemm("mlp_up_proj"), gemm("mlp_down_proj"))
        gemms: tuple[tuple[float, int, int], ...]
        expert_gemms: tuple[tuple[float, int, int], ...]
        if model.is_moe:
            router = (
                model.hidden_size * model.num_experts * w,
                model.hidden_size,
                model.num_experts,
            )
            gemms, expert_gemms = (*attention_gemms, router), mlp_gemms
        else:
            gemms, expert_gemms = (*attention_gemms, *mlp_gemms), ()
        kv_elem = kv_bytes_per_element(gear.kv_cache_dtype, prec)
        is_last = index == self.placement.pp - 1
        embed_bytes = max(prec.weight_bytes, prec.activation_bytes)
        lm_params = model.vocab_size * model.hidden_size / tp
        memory_ops = LayerShape.of(model).memory_elements_per_token(tp)
        router_params = model.hidden_size * model.num_experts if model.is_moe else 0
        dense_params = model.attention_params_per_layer + router_params
        if not model.is_moe:
            dense_params += model.mlp_params_per_expert
        active_params = (
            model.attention_params_per_layer
            + router_params
            + model.num_experts_per_tok * model.mlp_params_per_expert
        )
        return _StageCost(
            num_layers=num_layers,
            ops=ops,
            hbm_bytes_per_s=gpu.hbm_bandwidth_bytes_per_s * eff.hbm_efficiency,
            attention_flops_per_s=attention_rate,
            gemms=gemms,
            expert_gemms=expert_gemms,
            memory_ops=tuple(memory_ops.items()),
            activation_bytes=prec.activation_bytes,
            layer_weight_bytes=dense_params * w / tp,
            expert_weight_bytes=model.mlp_params_per_expert * w / tp,
            layer_flops_per_token=2.0 * active_params / tp,
            # QK^T and PV: 2 FLOPs per multiply-add, 2 matmuls, q_size wide.
            attention_flops_per_pair_per_layer=4.0 * model.q_size / tp,
            kv_bytes_per_token_per_layer=2 * kv_heads_per_gpu(model, tp) * model.head_dim * kv_elem,
            tp=tp,
            tp_link=None if tp_link is None else self._link_cost(tp_link),
            lm_head=(lm_params * embed_bytes, model.hidden_size, model.vocab_size // tp)
            if is_last
            else None,
        )

    def _link_cost(self, link: LinkSpec) -> LinkCost:
        eff = self.efficiency
        return LinkCost.of(
            link,
            eff.allreduce_bandwidth_efficiency,
            eff.p2p_bandwidth_efficiency,
            eff.calibration.link(link.name),
        )

    def factor_sets(self) -> dict[str, str]:
        """Which factors price each GPU type and link of the placement (for `estimate`)."""
        out: dict[str, str] = {}
        for gpu in self.placement.gpus:
            cal = self.efficiency.calibration.gpu(gpu.spec.name)
            out[gpu.spec.name] = (
                f"calibrated from {cal.source}"
                if cal is not None
                else "generic factors (no measurements of this GPU type)"
            )
        links = [st.tp_link for st in self._stages if st.tp_link is not None] + self._pp_links
        for lc in links:
            out[f"link {lc.link.name}"] = lc.factors
        return out

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

    def _gemms_s(
        self, st: _StageCost, gemms: tuple[tuple[float, int, int], ...], num_tokens: float
    ) -> float:
        # Calibrated GEMMs were measured with their activations; generic factors see weights.
        act = st.activation_bytes if st.ops.calibration is not None else 0.0
        total = 0.0
        for weight_bytes, k, n in gemms:
            num_bytes = weight_bytes + num_tokens * (k + n) * act
            total += st.ops.gemm_s(num_bytes, 2.0 * num_tokens * k * n, num_tokens)
        return total

    def _layer_kernels_s(self, st: _StageCost, num_tokens: int) -> float:
        """One layer's GEMMs, memory-bound ops and TP all-reduces for `num_tokens` tokens.

        Calibrated GPU types: kernel by kernel (the factors were fitted per kernel). Generic:
        one roofline over the layer's weights and active FLOPs, as the end-to-end generic
        factors were chosen for. Memoised: the sim engine and the planner ask for the same few
        token counts again and again."""
        key = (id(st), num_tokens)
        cached = self._kernels_memo.get(key)
        if cached is not None:
            return cached
        if st.ops.calibration is None:
            weight_bytes = st.layer_weight_bytes
            if st.expert_gemms:
                weight_bytes += self._experts_touched(num_tokens) * st.expert_weight_bytes
            linear = st.ops.gemm_s(weight_bytes, st.layer_flops_per_token * num_tokens, num_tokens)
            memory = 0.0  # folded into the generic hbm_efficiency
        else:
            linear = self._gemms_s(st, st.gemms, num_tokens)
            if st.expert_gemms:
                touched = self._experts_touched(num_tokens)
                per_expert = num_tokens * self.model.num_experts_per_tok / touched
                linear += touched * self._gemms_s(st, st.expert_gemms, per_expert)
            act = st.activation_bytes
            memory = sum(
                st.ops.memory_s(num_tokens * elements * act, num_tokens, op)
                for op, elements in st.memory_ops
            )
        comm = 0.0
        if st.tp > 1 and st.tp_link is not None:
            comm = 2 * st.tp_link.allreduce_s(num_tokens * self._handoff_bytes_per_token, st.tp)
        if len(self._kernels_memo) >= _MAX_MEMO:
            self._kernels_memo.clear()
        self._kernels_memo[key] = total = linear + memory + comm
        return total

    def _layer_s(self, st: _StageCost, num_tokens: int, kv_tokens: int, pairs: float) -> float:
        """One layer of `st`: its kernels for `num_tokens` tokens and attention over
        `kv_tokens` cached tokens and `pairs` query-key pairs (`_shape`)."""
        kernels = self._kernels_memo.get((id(st), num_tokens))
        if kernels is None:
            kernels = self._layer_kernels_s(st, num_tokens)
        attention = roofline_s(
            st.kv_bytes_per_token_per_layer * kv_tokens,
            st.attention_flops_per_pair_per_layer * pairs,
            st.hbm_bytes_per_s,
            st.attention_flops_per_s,
        )
        return kernels + attention

    def layer_time_s(self, batch: BatchShape, stage: int = 0) -> float:
        """One decoder layer of `stage` (its kernels, attention and TP all-reduces; no lm_head,
        no engine overhead): what `flexpipe calibrate` times on a random-weight layer."""
        self._check_runnable()
        return self._layer_s(self._stages[stage], *_shape(batch))

    def _stage_time_s(
        self, st: _StageCost, num_tokens: int, kv_tokens: int, pairs: float, num_seqs: int
    ) -> float:
        lm_head = 0.0
        if st.lm_head is not None:
            key = (id(st.lm_head), num_seqs)
            cached = self._kernels_memo.get(key)
            if cached is None:
                cached = self._kernels_memo[key] = self._gemms_s(st, (st.lm_head,), num_seqs)
            lm_head = cached
        return st.num_layers * self._layer_s(st, num_tokens, kv_tokens, pairs) + lm_head

    def stage_times_s(self, batch: BatchShape) -> list[float]:
        self._check_runnable()
        shape = _shape(batch)
        return [self._stage_time_s(st, *shape, batch.num_seqs) for st in self._stages]

    def handoff_s(self, batch: BatchShape, link: LinkSpec) -> float:
        """Sending one stage's hidden states for `batch` to the next stage over `link`."""
        return self._link_cost(link).p2p_s(batch.num_tokens * self._handoff_bytes_per_token)

    def _handoffs_s(self, num_tokens: int) -> float:
        message_bytes = num_tokens * self._handoff_bytes_per_token
        return sum(link.p2p_s(message_bytes) for link in self._pp_links)

    def _overhead_s(self, num_seqs: int) -> float:
        eff = self.efficiency
        return eff.step_overhead_s + eff.per_seq_overhead_s * num_seqs

    def step_time_s(self, batch: BatchShape) -> float:
        """Wall time of one iteration through every stage (latency of the batch).

        (The sim engine calls this every step: the batch's aggregates are read once, and
        a single stage or no hand-off skips the sums.)"""
        num_tokens = batch.num_prefill_tokens + batch.num_decode_seqs
        if num_tokens == 0:
            return 0.0
        if self._unsupported is not None:
            raise InfeasibleGear(self._unsupported)
        kv_tokens = batch.decode_context_tokens + batch.num_prefill_tokens
        pairs = batch.prefill_attention_tokens + batch.decode_context_tokens
        num_seqs = batch.num_prefill_seqs + batch.num_decode_seqs
        stages = self._stages
        if len(stages) == 1:
            total = self._stage_time_s(stages[0], num_tokens, kv_tokens, pairs, num_seqs)
        else:
            total = sum(
                [self._stage_time_s(st, num_tokens, kv_tokens, pairs, num_seqs) for st in stages]
            )
        if self._pp_links:
            total += self._handoffs_s(num_tokens)
        return total + self._overhead_s(num_seqs)

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
        slowest = max(self.stage_times_s(shape)) + self._handoffs_s(shape.num_tokens) / (pp - 1)
        return pp * (slowest + self._overhead_s(shape.num_seqs))

    def decode_tokens_per_s(self, batch_size: int, context_len: int) -> float:
        return batch_size / self.decode_interval_s(batch_size, context_len)

    # -- start-up, sleep and wake (flexpipe/perf/weights.py) ---------------------------------

    def weight_shards(self, node_of: Callable[[str], str] | None = None) -> tuple[GpuShard, ...]:
        """What each GPU loads: its share of the weights (a stage its layers, a rank its
        slice). `node_of`: GPU name -> node (a source like a disk is shared per node);
        None: one node."""
        eff = self.efficiency.host_link_efficiency
        return tuple(
            GpuShard(
                g.name,
                node_of(g.name) if node_of is not None else "",
                g.weights_bytes,
                gpu_spec(g.gpu_type).host_link_bandwidth_bytes_per_s * eff,
            )
            for g in self.memory.per_gpu
        )

    def default_weight_source(self) -> WeightSource:
        """Today's assumption: the checkpoint read once at `storage_bandwidth_bytes_per_s`."""
        return weights.storage(self.efficiency.storage_bandwidth_bytes_per_s)

    def weights_load_s(
        self, source: WeightSource | None = None, node_of: Callable[[str], str] | None = None
    ) -> float:
        """Bringing the weights onto the instance's GPUs from `source` (default: storage)."""
        src = source or self.default_weight_source()
        if src.kind == weights.STORAGE:
            # one reader for the whole checkpoint, as the cold start has always been priced
            assert src.bandwidth_bytes_per_s is not None
            return self.memory.weights_bytes / src.bandwidth_bytes_per_s
        return weights.load_s(self.weight_shards(node_of), src)

    def cold_start_s(
        self,
        storage_bandwidth_bytes_per_s: float | None = None,
        source: WeightSource | None = None,
        node_of: Callable[[str], str] | None = None,
    ) -> float:
        """A new engine: its weights loaded from `source` (default: every weight read once
        from storage), plus the engine's fixed start-up."""
        if source is None:
            bandwidth = (
                storage_bandwidth_bytes_per_s or self.efficiency.storage_bandwidth_bytes_per_s
            )
            source = weights.storage(bandwidth)
        return self.weights_load_s(source, node_of) + self.efficiency.engine_startup_s

    def sleep_s(self, level: int) -> float:
        """vLLM's sleep: level 1 copies every GPU's weights to host RAM over its host link
        (device to host, the links run the same rate both ways) and drops the KV cache; level
        2 drops both and level 0 only pauses scheduling: nothing to copy."""
        _check_level(level)
        return weights.load_s(self.weight_shards(), weights.host_ram()) if level == 1 else 0.0

    def wake_s(
        self,
        level: int,
        source: WeightSource | None = None,
        node_of: Callable[[str], str] | None = None,
    ) -> float:
        """Waking an engine asleep at `level`: level 1 copies the sleeping copy back (host to
        device); level 2 loads the weights from `source` (default: storage); no start-up
        either way (the process, allocator and CUDA graphs stayed). The KV cache is only
        re-mapped, empty: no copy."""
        _check_level(level)
        if level == 0:
            return 0.0
        if level == 1:
            return weights.load_s(self.weight_shards(node_of), weights.host_ram())
        return self.weights_load_s(source, node_of)

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


SLEEP_LEVELS = (0, 1, 2)  # vLLM's: pause only; weights to host RAM; discard all


def _check_level(level: int) -> None:
    if level not in SLEEP_LEVELS:
        raise ValueError(f"sleep level must be 0, 1 or 2, got {level!r}")


def perf_model_for(
    model: str | ModelSpec,
    gear: Gear | str = "tp=1",
    gpu_type: str = "A100-80G-SXM",
    link: str = "nvlink3",
    pp_link: str | None = None,
    efficiency: Efficiency | None = None,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
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

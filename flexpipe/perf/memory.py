"""Memory plan: what each GPU of a placement holds, and how much KV cache is left.

Weights: tensor parallelism splits every layer's matrices over the `tp` GPUs of a stage
(KV heads are replicated when tp exceeds them); pipeline parallelism gives each stage its
layers. The first stage holds the (vocab-parallel) embedding, the last the lm_head (a second
copy of the embedding when tied and pp > 1). Quantised precisions keep embedding and lm_head
in 16 bit, as vLLM does.

KV: each GPU stores K and V for its layers and its share of KV heads. vLLM sizes the cache
from the tightest GPU, so the instance's capacity is the minimum over GPUs.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION, Gear, GpuSlot, Placement
from flexpipe.model_spec import ModelSpec
from flexpipe.perf.efficiency import Efficiency
from flexpipe.precision import kv_bytes_per_element

GiB = float(2**30)


class InfeasibleGear(ValueError):
    """A gear that does not fit (or cannot run) on the GPUs given; the message says why."""


@dataclass(frozen=True, slots=True)
class GpuMemory:
    name: str
    gpu_type: str
    budget_bytes: float  # what the engine may use: min(util x capacity, free)
    weights_bytes: float
    reserve_bytes: float  # CUDA context, NCCL buffers, peak activations
    kv_bytes: float  # what is left for the KV cache (may be negative: does not fit)
    kv_bytes_per_token: float  # this GPU's share of one token's K and V


@dataclass(frozen=True, slots=True)
class MemoryPlan:
    per_gpu: tuple[GpuMemory, ...]
    kv_bytes_per_token: float  # the whole instance (every layer, every KV head)
    kv_capacity_tokens: int
    num_kv_blocks: int
    block_size: int
    max_model_len: int
    weights_bytes: float  # the whole instance
    feasible: bool
    reason: str | None

    def max_batch(self, context_len: int) -> int:
        """Most sequences of `context_len` tokens whose KV fits at once."""
        if context_len <= 0:
            raise ValueError("context_len must be positive")
        blocks_per_seq = math.ceil(context_len / self.block_size)
        return self.num_kv_blocks // blocks_per_seq


def _stage_weight_bytes(model: ModelSpec, gear: Gear, num_layers: int) -> float:
    prec = gear.precision
    return num_layers * model.params_per_layer * prec.weight_bytes / gear.tp


def _embedding_bytes_per_gpu(model: ModelSpec, gear: Gear) -> float:
    prec = gear.precision
    # Quantised checkpoints keep embedding and lm_head in 16 bit.
    bytes_per = max(prec.weight_bytes, prec.activation_bytes)
    return model.embedding_params * bytes_per / gear.tp


def activation_reserve_bytes(model: ModelSpec, gear: Gear, eff: Efficiency) -> float:
    """Peak activations of one step at the full token budget, per GPU, plus fixed costs.

    Per token in flight: the residual stream and attention in/out (~6 x hidden), the MLP's
    gate/up intermediate (2 x intermediate / tp), 16-bit. Plus fp32 logits for every
    sequence that samples (max_num_seqs x vocab / tp).
    """
    act_bytes = gear.precision.activation_bytes
    per_token = (6 * model.hidden_size + 2 * model.intermediate_size / gear.tp) * act_bytes
    logits = gear.max_num_seqs * model.vocab_size / gear.tp * 4.0
    fixed = eff.cuda_context_bytes + (eff.nccl_buffer_bytes if gear.num_gpus > 1 else 0.0)
    return gear.max_num_batched_tokens * per_token + logits + fixed


def kv_heads_per_gpu(model: ModelSpec, tp: int) -> int:
    """KV heads each TP rank stores: split, or replicated when tp exceeds them."""
    return max(1, model.num_kv_heads // tp)


def memory_plan(
    model: ModelSpec,
    gear: Gear,
    placement: Placement,
    eff: Efficiency,
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION,
    max_model_len: int | None = None,
) -> MemoryPlan:
    if placement.tp != gear.tp or placement.pp != gear.pp:
        raise InfeasibleGear(
            f"placement is tp={placement.tp} pp={placement.pp}, gear is tp={gear.tp} pp={gear.pp}"
        )
    if placement.num_layers != model.num_layers:
        raise InfeasibleGear(
            f"placement holds {placement.num_layers} layers, the model has {model.num_layers}"
        )
    if not 0 < gpu_memory_utilization <= 1:
        raise InfeasibleGear(f"gpu_memory_utilization {gpu_memory_utilization} not in (0, 1]")
    if model.num_heads % gear.tp:
        raise InfeasibleGear(
            f"tp={gear.tp} does not divide the model's {model.num_heads} attention heads"
        )
    model_len = max_model_len or min(model.max_position_embeddings, eff.default_max_model_len)
    kv_elem_bytes = kv_bytes_per_element(gear.kv_cache_dtype, gear.precision)
    kv_heads = kv_heads_per_gpu(model, gear.tp)
    reserve = activation_reserve_bytes(model, gear, eff)
    embed = _embedding_bytes_per_gpu(model, gear)

    per_gpu: list[GpuMemory] = []
    reasons: list[str] = []
    for i, stage in enumerate(placement.stages):
        weights = _stage_weight_bytes(model, gear, stage.num_layers)
        if i == 0:
            weights += embed
        if i == placement.pp - 1 and (not model.tie_word_embeddings or placement.pp > 1):
            weights += embed  # lm_head
        kv_per_token = stage.num_layers * 2 * kv_heads * model.head_dim * kv_elem_bytes
        for slot in stage.gpus:
            budget = engine_budget_bytes(slot, gpu_memory_utilization)
            per_gpu.append(
                GpuMemory(
                    name=slot.name,
                    gpu_type=slot.spec.name,
                    budget_bytes=budget,
                    weights_bytes=weights,
                    reserve_bytes=reserve,
                    kv_bytes=budget - weights - reserve,
                    kv_bytes_per_token=kv_per_token,
                )
            )
    capacity = min(
        int(g.kv_bytes // g.kv_bytes_per_token) if g.kv_bytes > 0 else 0 for g in per_gpu
    )
    num_blocks = capacity // gear.block_size
    capacity = num_blocks * gear.block_size
    min_kv_tokens = model_len
    for g in per_gpu:
        need = g.weights_bytes + g.reserve_bytes + min_kv_tokens * g.kv_bytes_per_token
        if need > g.budget_bytes:
            reasons.append(
                f"needs {need / GiB:.1f} GiB per GPU (weights {g.weights_bytes / GiB:.1f}, "
                f"reserve {g.reserve_bytes / GiB:.1f}, KV for one {model_len}-token sequence "
                f"{min_kv_tokens * g.kv_bytes_per_token / GiB:.1f}); "
                f"{g.name} has {g.budget_bytes / GiB:.1f} GiB free"
            )
    kv_per_token_total = sum(
        stage.num_layers * 2 * model.num_kv_heads * model.head_dim * kv_elem_bytes
        for stage in placement.stages
    )
    return MemoryPlan(
        per_gpu=tuple(per_gpu),
        kv_bytes_per_token=kv_per_token_total,
        kv_capacity_tokens=capacity if not reasons else 0,
        num_kv_blocks=num_blocks if not reasons else 0,
        block_size=gear.block_size,
        max_model_len=model_len,
        weights_bytes=model.num_params * gear.precision.weight_bytes,
        feasible=not reasons,
        reason=reasons[0] if reasons else None,
    )


def engine_budget_bytes(slot: GpuSlot, gpu_memory_utilization: float) -> float:
    """vLLM may use `utilization x capacity`, but never more than what other tenants left."""
    return min(slot.spec.memory_bytes * gpu_memory_utilization, slot.free_bytes)

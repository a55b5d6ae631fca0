"""The kernels of one transformer layer and what each costs on one GPU type.

A layer is four GEMMs (QKV, O, gate+up, down) and five memory-bound ops (two RMSNorms,
RoPE, SiLU-and-mul, the residual add), named as operator profiles name them (Vidur's
`attn_pre_proj`, ...), plus attention (costed in model.py). `OperatorCost` prices a GEMM or a
memory-bound op with a GPU type's factors: calibrated curves where measurements exist, the
generic `Efficiency` scalars otherwise. The performance model and the calibration fit both
price kernels here, so the error the fit reports is the error of the model.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.model_spec import ModelSpec
from flexpipe.perf.calibration import ANY_OP, GpuCalibration

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
MEMORY_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add")


@dataclass(frozen=True, slots=True)
class LayerShape:
    """The dimensions of a (gated-MLP, GQA) decoder layer that set its kernels' sizes."""

    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, model: ModelSpec) -> LayerShape:
        return cls(
            model.hidden_size,
            model.intermediate_size,
            model.num_heads,
            model.num_kv_heads,
            model.head_dim,
        )

    def gemm_dims(self, tp: int) -> dict[str, tuple[int, int]]:
        """op -> (in_features, out_features) on one of `tp` ranks (KV heads replicated when
        tp exceeds them)."""
        h = self.hidden_size
        q = self.num_heads * self.head_dim // tp
        kv = max(1, self.num_kv_heads // tp) * self.head_dim
        i = self.intermediate_size // tp
        return {
            "attn_pre_proj": (h, q + 2 * kv),
            "attn_post_proj": (q, h),
            "mlp_up_proj": (h, 2 * i),
            "mlp_down_proj": (i, h),
        }

    def memory_elements_per_token(self, tp: int) -> dict[str, int]:
        """op -> elements read plus written per token on one of `tp` ranks."""
        h = self.hidden_size
        q = self.num_heads * self.head_dim // tp
        kv = max(1, self.num_kv_heads // tp) * self.head_dim
        return {
            "input_layernorm": 2 * h,
            "post_attention_layernorm": 2 * h,
            "attn_rope": 2 * (q + kv),
            "mlp_act": 3 * self.intermediate_size // tp,
            "add": 3 * h,
        }


def gemm_bytes_flops(
    num_tokens: float,
    in_features: int,
    out_features: int,
    weight_bytes: float,
    activation_bytes: float,
) -> tuple[float, float]:
    """HBM bytes (weights once, activations in and out) and FLOPs of `tokens x in @ in x out`."""
    num_bytes = (
        in_features * out_features * weight_bytes
        + num_tokens * (in_features + out_features) * activation_bytes
    )
    return num_bytes, 2.0 * num_tokens * in_features * out_features


@dataclass(frozen=True, slots=True)
class OperatorCost:
    """Prices kernels on one GPU type at one GEMM precision.

    Generic: `max(bytes / (HBM x hbm_eff), FLOPs / (peak x compute_eff))`, and memory-bound ops
    folded into that. Calibrated: `floor + roofline at peak / efficiency(tokens)`
    (see `GpuCalibration`).
    """

    hbm_bytes_per_s: float  # datasheet peak
    flops_per_s: float  # datasheet peak at the GEMM's precision
    hbm_efficiency: float  # generic factors, used when calibration is None
    compute_efficiency: float
    calibration: GpuCalibration | None

    def gemm_s(self, num_bytes: float, flops: float, num_tokens: float) -> float:
        cal = self.calibration
        if cal is None:
            return max(
                num_bytes / (self.hbm_bytes_per_s * self.hbm_efficiency),
                flops / (self.flops_per_s * self.compute_efficiency),
            )
        ideal = max(num_bytes / self.hbm_bytes_per_s, flops / self.flops_per_s)
        return cal.gemm.time_s(ideal, num_tokens)

    def memory_s(self, num_bytes: float, num_tokens: float, op: str = ANY_OP) -> float:
        """A memory-bound op (`op` picks its calibrated factors; see MEMORY_OPS). Generic
        factors price none: they are end-to-end figures with these ops folded in."""
        cal = self.calibration
        if cal is None:
            return 0.0
        return cal.memory_for(op).time_s(num_bytes / self.hbm_bytes_per_s, num_tokens)

"""Precisions: how many bytes a weight, an activation and a KV entry take, and which tensor
cores do the math.

A precision names the weight format the way vLLM's `--dtype` / `--quantization` do. The KV
cache dtype is chosen separately (`--kv-cache-dtype`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flexpipe.hardware import GpuSpec

ComputeKind = Literal["fp32", "fp16", "bf16", "fp8", "int8"]


@dataclass(frozen=True, slots=True)
class Precision:
    name: str
    weight_bytes: float  # bytes per weight element, scales included
    compute: ComputeKind  # which tensor-core rate runs the GEMMs
    activation_bytes: float  # bytes per activation element exchanged between GPUs
    description: str
    vllm_dtype: str  # what `vllm serve --dtype` gets
    vllm_quantization: str | None  # what `vllm serve --quantization` gets


PRECISIONS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision("fp32", 4.0, "fp32", 4.0, "32-bit float", "float32", None),
        Precision("bf16", 2.0, "bf16", 2.0, "bfloat16", "bfloat16", None),
        Precision("fp16", 2.0, "fp16", 2.0, "float16", "float16", None),
        # FP8 W8A8 (e4m3, per-tensor scales): Hopper/Ada tensor cores.
        Precision("fp8", 1.0, "fp8", 2.0, "FP8 weights and activations (W8A8)", "auto", "fp8"),
        # INT8 W8A8 (SmoothQuant-style, vLLM compressed-tensors).
        Precision(
            "int8",
            1.0,
            "int8",
            2.0,
            "INT8 weights and activations (W8A8)",
            "auto",
            "compressed-tensors",
        ),
        # INT4 weight-only (AWQ / GPTQ, group size 128): 0.5 B per weight plus one fp16 scale
        # and zero point per 128 weights = 0.5 + 4/128 B. Math runs in fp16 after dequant.
        Precision(
            "int4-awq", 0.5 + 4 / 128, "fp16", 2.0, "INT4 weight-only, AWQ", "float16", "awq"
        ),
        Precision(
            "int4-gptq", 0.5 + 4 / 128, "fp16", 2.0, "INT4 weight-only, GPTQ", "float16", "gptq"
        ),
    )
}
PRECISION_ALIASES = {
    "int4": "int4-awq",
    "awq": "int4-awq",
    "gptq": "int4-gptq",
    "w8a8": "int8",
    "float16": "fp16",
    "half": "fp16",
    "bfloat16": "bf16",
    "float32": "fp32",
    "float": "fp32",
    "auto": "bf16",
}

# KV cache element sizes (`--kv-cache-dtype`): auto follows the model dtype.
KV_CACHE_DTYPE_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "fp8_e4m3": 1.0,
    "fp8_e5m2": 1.0,
    "int8": 1.0,
}


class PrecisionError(ValueError):
    """An unknown precision or one the GPU cannot run."""


def precision(name: str) -> Precision:
    key = name.strip().lower()
    key = PRECISION_ALIASES.get(key, key)
    try:
        return PRECISIONS[key]
    except KeyError:
        known = sorted([*PRECISIONS, *PRECISION_ALIASES])
        raise PrecisionError(f"unknown precision {name!r}; known: {', '.join(known)}") from None


def kv_bytes_per_element(kv_cache_dtype: str, weights: Precision) -> float:
    """Bytes per KV element; `auto` stores KV in the activation dtype (16-bit)."""
    key = kv_cache_dtype.strip().lower()
    if key == "auto":
        return weights.activation_bytes if weights.compute != "fp32" else 4.0
    try:
        return KV_CACHE_DTYPE_BYTES[key]
    except KeyError:
        known = ", ".join(["auto", *KV_CACHE_DTYPE_BYTES])
        raise PrecisionError(f"unknown kv cache dtype {kv_cache_dtype!r}; known: {known}") from None


def compute_flops_per_s(gpu: GpuSpec, prec: Precision) -> float:
    """Dense tensor-core rate for this precision on this GPU, or PrecisionError if unsupported.

    fp32 GEMMs run on TF32 tensor cores where they exist (half the fp16 rate on Ampere+); on
    Volta they run on CUDA cores (~1/8 of fp16 tensor).
    """
    if prec.compute == "fp16":
        return gpu.fp16_flops_per_s
    if prec.compute == "bf16":
        if gpu.bf16_flops_per_s is None:
            raise PrecisionError(f"{gpu.name} has no bf16 support; use fp16 (--dtype half)")
        return gpu.bf16_flops_per_s
    if prec.compute == "fp8":
        if gpu.fp8_flops_per_s is None:
            raise PrecisionError(f"{gpu.name} has no fp8 tensor cores")
        return gpu.fp8_flops_per_s
    if prec.compute == "int8":
        if gpu.int8_ops_per_s is None:
            raise PrecisionError(f"{gpu.name} has no int8 tensor cores")
        return gpu.int8_ops_per_s
    # fp32
    if gpu.bf16_flops_per_s is None:
        return gpu.fp16_flops_per_s / 8
    return gpu.fp16_flops_per_s / 2

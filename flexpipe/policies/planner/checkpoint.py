"""Which weights an engine loads for each precision (docs/engines.md, docs/planner.md).

A real engine cannot serve a precision without weights in it. bf16, fp16 and fp32 load the
model's own weights (the engine casts them); fp8 quantizes them as it loads (`--quantization
fp8`, dynamic); int8 and int4 need a checkpoint somebody quantized (W8A8, AWQ, GPTQ) and its
method. The models file names them:

```yaml
    weights: meta-llama/Llama-2-7b-hf     # HF repo id or local path (default: the catalog's)
    checkpoints:
      int4: {path: TheBloke/Llama-2-7B-AWQ, quantization: awq}
      int8: {path: neuralmagic/Llama-2-7b-chat-quantized.w8a8, quantization: compressed-tensors}
```

A precision with no checkpoint is not planned. Methods are named as vLLM's `--quantization`
names them; `flexpipe.launch.command` turns them into each engine's spelling.
"""

from __future__ import annotations

from collections.abc import Mapping

from flexpipe.policies.planner.types import Checkpoint, ModelDemand

__all__ = [
    "QUANTIZATION_METHODS",
    "CheckpointError",
    "checkpoint",
    "checkpoint_for",
    "family",
    "precision_of",
    "servable",
    "unplanned_notes",
]

# precision family -> the checkpoint quantization methods flexpipe launches it with.
QUANTIZATION_METHODS: Mapping[str, tuple[str, ...]] = {
    "fp8": ("fp8", "compressed-tensors", "modelopt"),
    "int8": ("compressed-tensors",),
    "int4": ("awq", "awq_marlin", "gptq", "gptq_marlin", "compressed-tensors"),
}
# precisions served from the model's own weights, and how the engine is told (None: as is)
_FROM_WEIGHTS: Mapping[str, str | None] = {"bf16": None, "fp16": None, "fp32": None, "fp8": "fp8"}


class CheckpointError(ValueError):
    """A checkpoint entry that cannot be launched; one readable line."""


def family(precision: str) -> str:
    """`int4-awq` and `int4-gptq` are one family (4-bit weights): the checkpoint's method picks
    the variant."""
    return "int4" if precision.startswith("int4") else precision


def precision_of(family_name: str, quantization: str | None) -> str:
    """The precision a checkpoint of `family_name` quantized by `quantization` runs as."""
    if family_name != "int4":
        return family_name
    return "int4-gptq" if (quantization or "").startswith("gptq") else "int4-awq"


def checkpoint(family_name: str, path: str, quantization: str | None) -> Checkpoint:
    """A declared checkpoint, checked: quantized families need a known method."""
    methods = QUANTIZATION_METHODS.get(family_name)
    if methods is None:
        if quantization is not None:
            raise CheckpointError(
                f"{family_name} weights are not quantized: drop `quantization: {quantization}`"
            )
        return Checkpoint(family_name, path, None)
    if quantization is None:
        raise CheckpointError(
            f"a checkpoint for {family_name} needs its quantization method "
            f"(one of {', '.join(methods)})"
        )
    if quantization not in methods:
        raise CheckpointError(
            f"unknown {family_name} quantization method {quantization!r}; "
            f"use one of {', '.join(methods)}"
        )
    return Checkpoint(precision_of(family_name, quantization), path, quantization)


def checkpoint_for(
    precision: str, weights: str, declared: tuple[Checkpoint, ...]
) -> Checkpoint | None:
    """The checkpoint that serves `precision`: a declared one of its family, else the model's
    weights where the engine can make the precision from them; None: nothing can serve it."""
    for ckpt in declared:
        if family(ckpt.precision) == family(precision):
            return ckpt
    if precision in _FROM_WEIGHTS:
        return Checkpoint(precision, weights, _FROM_WEIGHTS[precision])
    return None


def servable(
    dtypes: tuple[str, ...], weights: str, declared: tuple[Checkpoint, ...]
) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the precisions to plan, the accepted ones no checkpoint serves). An int4 precision
    becomes its checkpoint's variant (`int4` with a GPTQ checkpoint plans `int4-gptq`)."""
    kept: list[str] = []
    missing: list[str] = []
    for d in dtypes:
        ckpt = checkpoint_for(d, weights, declared)
        if ckpt is None:
            missing.append(d)
        elif ckpt.precision not in kept:
            kept.append(ckpt.precision)
    return tuple(kept), tuple(missing)


def unplanned_notes(demands: tuple[ModelDemand, ...]) -> list[str]:
    """One line per model whose accepted precisions some lack a checkpoint (`flexpipe plan`)."""
    return [
        f"{d.name}: {', '.join(d.dtypes_without_checkpoint)} not planned: no checkpoint "
        "(name one under `checkpoints:` in the models file, with its quantization method)"
        for d in demands
        if d.dtypes_without_checkpoint
    ]

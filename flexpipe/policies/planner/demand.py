"""The models file: which models to serve, their demand and SLOs (docs/planner.md).

```yaml
models:
  - name: llama-7b            # served model name (what clients ask for)
    model: llama-2-7b         # model spec id or path to a config.json
    demand: {request_rate_per_s: 12, input_tokens: 512, output_tokens: 128}
    slo: {ttft_p99_ms: 1000, tpot_p99_ms: 60}
    dtypes: [bf16]            # optional; precisions the owner accepts
    max_model_len: 4096       # optional
    priority: 2               # optional (default 1): weight of its requests in the objective
    min_instances: 1          # optional (default 0): never fewer when the GPUs allow it
    weights: meta-llama/Llama-2-7b-hf   # optional: HF repo id or path real engines load
                                        # (default: the catalog's repo id, or the config's folder)
    checkpoints:              # optional: quantized weights per precision (checkpoint.py)
      int4: {path: TheBloke/Llama-2-7B-AWQ, quantization: awq}
```

A precision in `dtypes` that no checkpoint serves (int8 and int4 need a named one) is left out
of the demand's `dtypes` and listed in `dtypes_without_checkpoint`; when none is left, that is
an error.

`parse_models` validates a parsed document (pure); reading the file is the caller's job.
"""

from __future__ import annotations

import math
from pathlib import PurePath
from typing import Any

from flexpipe.model_spec import ModelSpec, ModelSpecError, load_model_spec
from flexpipe.policies.planner.checkpoint import CheckpointError, checkpoint, family, servable
from flexpipe.policies.planner.types import Checkpoint, ModelDemand, Slo
from flexpipe.precision import PrecisionError, precision

__all__ = ["ModelsFileError", "parse_models"]

_MODEL_KEYS = {
    "name",
    "model",
    "demand",
    "slo",
    "dtypes",
    "max_model_len",
    "priority",
    "min_instances",
    "weights",
    "checkpoints",
}
_DEMAND_KEYS = {"request_rate_per_s", "input_tokens", "output_tokens"}
_DEMAND_OPTIONAL = {"arrival_cv2"}  # burstiness (default 1: Poisson); read by sizing: slo
_SLO_KEYS = {"ttft_p99_ms", "tpot_p99_ms"}
_CHECKPOINT_KEYS = {"path", "quantization"}


class ModelsFileError(ValueError):
    """A models file that does not make sense; one line per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


def _number(doc: dict[str, Any], key: str, place: str, errors: list[str]) -> float:
    value = doc.get(key)
    if isinstance(value, bool) or not isinstance(value, int | float):
        errors.append(f"{place}.{key}: expected a number, got {value!r}")
        return 0.0
    if not math.isfinite(value):
        errors.append(f"{place}.{key}: expected a finite number, got {value!r}")
        return 0.0
    if value <= 0 and key != "request_rate_per_s":
        errors.append(f"{place}.{key}: must be positive (got {value})")
    elif value < 0:
        errors.append(f"{place}.{key}: must be >= 0 (got {value})")
    return float(value)


def _section(
    doc: dict[str, Any],
    key: str,
    keys: set[str],
    place: str,
    errors: list[str],
    optional: frozenset[str] | set[str] = frozenset(),
) -> dict[str, Any]:
    value = doc.get(key)
    if not isinstance(value, dict):
        errors.append(f"{place}.{key}: expected a mapping with {', '.join(sorted(keys))}")
        return {}
    unknown = sorted(set(value) - keys - optional)
    if unknown:
        errors.append(f"{place}.{key}: unknown key(s) {', '.join(map(str, unknown))}")
    missing = sorted(keys - set(value))
    if missing:
        errors.append(f"{place}.{key}: missing {', '.join(missing)}")
    return value


def parse_models(doc: object, source: str = "<models>") -> tuple[ModelDemand, ...]:
    """Validate a models document; every problem is reported at once (ModelsFileError)."""
    errors: list[str] = []
    if not isinstance(doc, dict) or not isinstance(doc.get("models"), list) or not doc["models"]:
        raise ModelsFileError([f"{source}: expected `models:` with a list of at least one model"])
    out: list[ModelDemand] = []
    names: set[str] = set()
    for i, item in enumerate(doc["models"]):
        place = f"{source}: models[{i}]"
        if not isinstance(item, dict):
            errors.append(f"{place}: expected a mapping")
            continue
        ok = len(errors)
        unknown = sorted(set(item) - _MODEL_KEYS)
        if unknown:
            errors.append(f"{place}: unknown key(s) {', '.join(map(str, unknown))}")
        model = item.get("model")
        name = item.get("name", model)
        spec: ModelSpec | None = None
        if not isinstance(model, str):
            errors.append(f"{place}.model: expected a model id or config.json path")
        else:
            try:
                spec = load_model_spec(model)
            except ModelSpecError as exc:
                errors.append(f"{place}.model: {exc}")
        if not isinstance(name, str):
            errors.append(f"{place}.name: expected a string")
        elif name in names:
            errors.append(f"{place}.name: duplicate model name {name!r}")
        else:
            names.add(name)
        demand = _section(item, "demand", _DEMAND_KEYS, place, errors, _DEMAND_OPTIONAL)
        cv2 = 1.0
        if demand and "arrival_cv2" in demand:
            cv2 = _number(demand, "arrival_cv2", f"{place}.demand", errors)
        rate = _number(demand, "request_rate_per_s", f"{place}.demand", errors) if demand else 0
        inp = _number(demand, "input_tokens", f"{place}.demand", errors) if demand else 0
        outp = _number(demand, "output_tokens", f"{place}.demand", errors) if demand else 0
        slo = _section(item, "slo", _SLO_KEYS, place, errors)
        ttft = _number(slo, "ttft_p99_ms", f"{place}.slo", errors) if slo else 0
        tpot = _number(slo, "tpot_p99_ms", f"{place}.slo", errors) if slo else 0
        dtypes_value = item.get("dtypes", ["bf16"])
        dtypes: list[str] = []
        if not isinstance(dtypes_value, list) or not dtypes_value:
            errors.append(f"{place}.dtypes: expected a list of precisions")
        else:
            for d in dtypes_value:
                try:
                    dtypes.append(precision(str(d)).name)
                except PrecisionError as exc:
                    errors.append(f"{place}.dtypes: {exc}")
        weights = _weights(item, model, spec, place, errors)
        declared = _checkpoints(item.get("checkpoints", {}), place, errors)
        planned, missing = servable(tuple(dtypes), weights, declared)
        if dtypes and not planned and len(errors) == ok:
            errors.append(
                f"{place}.dtypes: no checkpoint serves {', '.join(missing)}; name one under "
                f"`checkpoints:` (e.g. {family(missing[0])}: {{path: REPO, quantization: "
                "METHOD}) or accept bf16"
            )
        max_len = item.get("max_model_len")
        if max_len is not None and (
            isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1
        ):
            errors.append(f"{place}.max_model_len: expected a positive integer")
        priority = item.get("priority", 1)
        if (
            isinstance(priority, bool)
            or not isinstance(priority, int | float)
            or not math.isfinite(priority)
            or priority <= 0
        ):
            errors.append(f"{place}.priority: expected a positive number, got {priority!r}")
        min_instances = item.get("min_instances", 0)
        if (
            isinstance(min_instances, bool)
            or not isinstance(min_instances, int)
            or min_instances < 0
        ):
            errors.append(f"{place}.min_instances: expected an integer >= 0, got {min_instances!r}")
        if len(errors) > ok:
            continue
        assert isinstance(name, str) and isinstance(model, str)
        out.append(
            ModelDemand(
                name=name,
                model=model,
                request_rate_per_s=rate,
                input_tokens=int(inp),
                output_tokens=int(outp),
                slo=Slo(ttft_p99_s=ttft / 1e3, tpot_p99_s=tpot / 1e3),
                dtypes=planned,
                max_model_len=max_len,
                priority=float(priority),
                min_instances=min_instances,
                weights=weights,
                checkpoints=declared,
                dtypes_without_checkpoint=missing,
                arrival_cv2=cv2,
            )
        )
    if errors:
        raise ModelsFileError(errors)
    return tuple(out)


def _weights(
    item: dict[str, Any], model: object, spec: ModelSpec | None, place: str, errors: list[str]
) -> str:
    """The weights real engines load: `weights:`, else the catalog's repo id, else the folder
    of the config.json the model was read from."""
    value = item.get("weights")
    if value is not None:
        if not isinstance(value, str) or not value.strip():
            errors.append(f"{place}.weights: expected a Hugging Face repo id or a local path")
            return ""
        return value.strip()
    if spec is not None and spec.hf_repo:
        return spec.hf_repo
    text = str(model)
    return str(PurePath(text).parent) if text.endswith("config.json") else text


def _checkpoints(value: object, place: str, errors: list[str]) -> tuple[Checkpoint, ...]:
    """`checkpoints: {PRECISION: {path, quantization}}`, each checked (one line per problem)."""
    if not isinstance(value, dict):
        errors.append(
            f"{place}.checkpoints: expected a mapping of precision -> {{path, quantization}}"
        )
        return ()
    out: list[Checkpoint] = []
    for key, entry in value.items():
        at = f"{place}.checkpoints.{key}"
        try:
            fam = family(precision(str(key)).name)
        except PrecisionError as exc:
            errors.append(f"{at}: {exc}")
            continue
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str):
            errors.append(f"{at}: expected {{path: REPO_OR_PATH, quantization: METHOD}}")
            continue
        unknown = sorted(set(entry) - _CHECKPOINT_KEYS)
        if unknown:
            errors.append(f"{at}: unknown key(s) {', '.join(map(str, unknown))}")
            continue
        method = entry.get("quantization")
        if any(family(c.precision) == fam for c in out):
            errors.append(f"{at}: a second {fam} checkpoint; name one per precision")
            continue
        try:
            out.append(checkpoint(fam, entry["path"], None if method is None else str(method)))
        except CheckpointError as exc:
            errors.append(f"{at}: {exc}")
    return tuple(out)

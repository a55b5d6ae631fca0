"""A scenario file: the cluster, the models with their SLOs, the workload per model, the
policy under test, the duration and the seed (docs/simulator.md has the format).

```yaml
name: seed-fragmented
duration_s: 600
seed: 0
policy: flexpipe                     # flexpipe | round_robin | peak | wait-for-ideal
cluster: {file: ../../../examples/clusters/fragmented-4gpu.yaml}   # or {inline: {...}},
                                     # or {generate: {nodes: 32, gpus_per_node: 8, seed: 0}}
models:                              # as a models file (docs/planner.md); `demand` optional:
  - name: llama-7b                   # without it the planner is given the workload's mean
    model: llama-2-7b
    slo: {ttft_p99_ms: 2000, tpot_p99_ms: 50}
workloads:
  - model: llama-7b
    arrivals: {process: poisson, rate_per_s: 4}     # or gamma with cv: 3
    diurnal: {period_s: 3600, amplitude: 0.5, peak_s: 1800}              # optional
    prompt_tokens: {dist: lognormal, mean: 1024, cv: 0.5, max: 3072}
    output_tokens: {dist: exponential, mean: 128, max: 1024}
    shared_prefix: {num_groups: 8, num_tokens: 1024}                       # optional
  - model: llama-7b
    trace: {kind: azure, file: azure.csv, speedup: 1.0, offset_s: 0}     # or mooncake
gateway: {routing: {policy: prefix_affinity}, max_queue: 1024}          # GatewayConfig
report_interval_s: 60
resources:                           # the resource timeline (flexpipe.sim.timeline)
  - {at_s: 600, release: [gpu1]}
  - {at_s: 900, reclaim: [gpu3], notice_s: 300}
  - {at_s: 1200, fail: [gpu0]}
controller: {tick_s: 10, drain_deadline_s: 30, min_instances_floor: 1,
             shift: {triggers: {cooldown_s: 180}}}                 # docs/shift-policy.md
plans:                               # fixed plans, run with --policy NAME
  forced-3way:
    - {model: llama-7b, gear: "pp=3", stages: [[gpu0], [gpu1], [gpu2]]}
```
Paths are relative to the scenario file. Every mistake is one readable line (ScenarioError).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from flexpipe.cluster import Cluster, ClusterError, load_cluster, parse_cluster
from flexpipe.cluster.generate import generate_cluster
from flexpipe.gateway.config import ConfigError, GatewayConfig, config_from_dict
from flexpipe.gears.gear import Gear, GearError, parse_gear
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import ModelsFileError
from flexpipe.policies.shift import ShiftParams
from flexpipe.sim.controller import ControllerParams
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.timeline import TimelineError, TimelineEvent, parse_timeline
from flexpipe.sim.trace import TraceReplay
from flexpipe.sim.workload import (
    Diurnal,
    LengthDist,
    SharedPrefix,
    Synthetic,
    WorkloadError,
)

_KEYS = {
    "name", "description", "duration_s", "seed", "policy", "cluster", "models", "workloads",
    "gateway", "report_interval_s", "resources", "controller", "plans",
}  # fmt: skip
_CONTROLLER_KEYS = {"tick_s", "drain_deadline_s", "rehearsal_tolerance", "min_instances_floor",
                    "shift"}  # fmt: skip
_WORKLOAD_KEYS = {
    "model", "arrivals", "diurnal", "prompt_tokens", "output_tokens", "shared_prefix", "trace",
}  # fmt: skip


class ScenarioError(ValueError):
    """A scenario that cannot be run; one readable line."""


@dataclass(frozen=True, slots=True)
class Workload:
    model: str
    source: Synthetic | TraceReplay


@dataclass(frozen=True)
class Scenario:
    name: str
    cluster: Cluster
    models: list[dict[str, Any]]  # the models-file entries (`demand` may be missing)
    workloads: tuple[Workload, ...]
    duration_s: float
    seed: int = 0
    policy: str = "flexpipe"
    gateway: GatewayConfig = field(default_factory=GatewayConfig)
    report_interval_s: float = 60.0
    description: str = ""
    resources: tuple[TimelineEvent, ...] = ()
    controller: ControllerParams = field(default_factory=ControllerParams)
    plans: dict[str, tuple[Deployment, ...]] = field(default_factory=dict)

    @property
    def model_names(self) -> list[str]:
        return [str(m.get("name", m.get("model"))) for m in self.models]


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a mapping")
    return value


def _build(cls: Any, value: Any, where: str) -> Any:
    try:
        return cls(**_mapping(value, where))
    except TypeError as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def _cluster(value: Any, base: Path, where: str) -> Cluster:
    doc = _mapping(value, where)
    try:
        if "file" in doc:
            return load_cluster(base / str(doc["file"]))
        if "inline" in doc:
            return parse_cluster(doc["inline"], f"{where}.inline")
        if "generate" in doc:
            g = _mapping(doc["generate"], f"{where}.generate")
            return generate_cluster(
                int(g.get("nodes", 1)), int(g.get("gpus_per_node", 8)), int(g.get("seed", 0))
            )
    except ClusterError as exc:
        raise ScenarioError(str(exc).replace("\n", "; ")) from None
    raise ScenarioError(f"{where}: give `file`, `inline` or `generate`")


def _workload(value: Any, base: Path, where: str, models: list[str]) -> Workload:
    doc = _mapping(value, where)
    unknown = sorted(set(doc) - _WORKLOAD_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    model = doc.get("model", models[0] if len(models) == 1 else None)
    if model not in models:
        raise ScenarioError(f"{where}.model: {model!r} is not one of the models {models}")
    try:
        if "trace" in doc:
            t = dict(_mapping(doc["trace"], f"{where}.trace"))
            t["path"] = base / str(t.pop("file", ""))
            if not t["path"].is_file():
                raise ScenarioError(f"{where}.trace: trace file {t['path']} does not exist")
            return Workload(model, _build(TraceReplay, t, f"{where}.trace"))
        arrivals = dict(_mapping(doc.get("arrivals"), f"{where}.arrivals"))
        process = arrivals.pop("process", "poisson")
        source = Synthetic(
            rate_per_s=float(arrivals.pop("rate_per_s", 0)),
            arrival=str(process),
            cv=float(arrivals.pop("cv", 1.0)),
            start_s=float(arrivals.pop("start_s", 0.0)),
            prompt=_build(LengthDist, doc.get("prompt_tokens", {}), f"{where}.prompt_tokens"),
            output=_build(LengthDist, doc.get("output_tokens", {}), f"{where}.output_tokens"),
            diurnal=_build(Diurnal, doc["diurnal"], f"{where}.diurnal") if "diurnal" in doc
            else None,
            shared_prefix=_build(SharedPrefix, doc["shared_prefix"], f"{where}.shared_prefix")
            if "shared_prefix" in doc else None,
        )  # fmt: skip
        if arrivals:
            raise ScenarioError(f"{where}.arrivals: unknown key(s) {', '.join(sorted(arrivals))}")
        return Workload(model, source)
    except WorkloadError as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def _controller(value: Any, where: str) -> ControllerParams:
    doc = dict(_mapping(value or {}, where))
    unknown = sorted(set(doc) - _CONTROLLER_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        shift = ShiftParams.from_mapping(doc.pop("shift", {}) or {})
        return ControllerParams(**{k: type(getattr(ControllerParams(), k))(v)
                                   for k, v in doc.items()}, shift=shift)  # fmt: skip
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None


def _plans(
    value: Any, models: list[dict[str, Any]], where: str
) -> dict[str, tuple[Deployment, ...]]:
    ids = {str(m.get("name", m.get("model"))): str(m.get("model")) for m in models}
    out: dict[str, tuple[Deployment, ...]] = {}
    for name, deps in _mapping(value or {}, where).items():
        place = f"{where}.{name}"
        if not isinstance(deps, list) or not deps:
            raise ScenarioError(f"{place}: expected a list of deployments")
        built = []
        for i, d in enumerate(deps):
            d = _mapping(d, f"{place}[{i}]")
            model = str(d.get("model", next(iter(ids))))
            if model not in ids:
                raise ScenarioError(f"{place}[{i}].model: {model!r} is not one of {list(ids)}")
            stages = d.get("stages")
            if not isinstance(stages, list) or not stages:
                raise ScenarioError(f"{place}[{i}].stages: a list of GPU id lists")
            try:
                gear = parse_gear(str(d.get("gear", "")), Gear())
            except GearError as exc:
                raise ScenarioError(f"{place}[{i}].gear: {exc}") from None
            try:
                load_model_spec(ids[model])
            except (KeyError, ValueError) as exc:
                raise ScenarioError(f"{place}[{i}]: {exc}") from None
            built.append(Deployment(
                f"{model}-{name}-{i}", model, ids[model], gear,
                tuple(tuple(str(g) for g in st) for st in stages),
            ))  # fmt: skip
        out[str(name)] = tuple(built)
    return out


def parse_scenario(doc: Any, base: Path, source: str = "<scenario>") -> Scenario:
    doc = _mapping(doc, source)
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise ScenarioError(f"{source}: unknown key(s) {', '.join(unknown)}")
    models = doc.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise ScenarioError(f"{source}: `models` must list at least one model")
    names = [str(m.get("name", m.get("model"))) for m in models]
    workloads = doc.get("workloads")
    if not isinstance(workloads, list) or not workloads:
        raise ScenarioError(f"{source}: `workloads` must list at least one workload")
    duration = doc.get("duration_s")
    if not isinstance(duration, int | float) or duration <= 0:
        raise ScenarioError(f"{source}: duration_s must be a positive number")
    try:
        gateway = config_from_dict(_mapping(doc.get("gateway") or {}, f"{source}: gateway"))
    except ConfigError as exc:
        raise ScenarioError(f"{source}: gateway: {exc}") from None
    cluster = _cluster(doc.get("cluster"), base, f"{source}: cluster")
    try:
        resources = parse_timeline(doc.get("resources"), cluster, f"{source}: resources")
    except TimelineError as exc:
        raise ScenarioError(str(exc)) from None
    return Scenario(
        name=str(doc.get("name", source)),
        description=str(doc.get("description", "")),
        cluster=cluster,
        resources=resources,
        controller=_controller(doc.get("controller"), f"{source}: controller"),
        plans=_plans(doc.get("plans"), [dict(m) for m in models], f"{source}: plans"),
        models=[dict(m) for m in models],
        workloads=tuple(
            _workload(w, base, f"{source}: workloads[{i}]", names) for i, w in enumerate(workloads)
        ),
        duration_s=float(duration),
        seed=int(doc.get("seed", 0)),
        policy=str(doc.get("policy", "flexpipe")),
        gateway=gateway,
        report_interval_s=float(doc.get("report_interval_s", 60.0)),
    )


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the file: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: YAML syntax error: {exc}") from None
    return parse_scenario(doc, path.parent, str(path))


def builtin_dir() -> Path:
    return Path(__file__).parent / "scenarios"


def builtin_scenarios() -> dict[str, Path]:
    """Built-in scenario name -> file (`flexpipe sim list`)."""
    return {p.stem: p for p in sorted(builtin_dir().glob("*.yaml"))}


def resolve(name_or_path: str) -> Path:
    """A built-in scenario's name, or a path."""
    builtin = builtin_scenarios().get(name_or_path)
    return builtin if builtin is not None else Path(name_or_path)


__all__ = [
    "ModelsFileError",
    "Scenario",
    "ScenarioError",
    "Workload",
    "builtin_scenarios",
    "load_scenario",
    "parse_scenario",
    "resolve",
]

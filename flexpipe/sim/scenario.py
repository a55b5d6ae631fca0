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
  # optional: deadline-aware admission (docs/simulator.md); the models' TTFT SLOs and
  # priorities fill `ttft_slo_s` and `priority` where the block does not name them
  # admission: {order: slack, shed_late: true, shed_margin_s: 0.5}
report_interval_s: 60
resources:                           # the resource timeline (flexpipe.sim.timeline)
  - {at_s: 600, release: [gpu1]}
  - {at_s: 900, reclaim: [gpu3], notice_s: 300}
  - {at_s: 1200, fail: [gpu0]}
start: {warm: true, expected_window_s: 60}   # deployed before traffic (flexpipe.sim.start)
controller: {tick_s: 10, drain_deadline_s: 30, min_instances_floor: 1,
             shift: {triggers: {cooldown_s: 180}}}                 # docs/shift-policy.md
plans:                               # fixed plans, run with --policy NAME
  forced-3way:
    - {model: llama-7b, gear: "pp=3", stages: [[gpu0], [gpu1], [gpu2]]}
```
Paths are relative to the scenario file. Every mistake is one readable line (ScenarioError).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from flexpipe.cluster import Cluster, ClusterError, load_cluster, parse_cluster
from flexpipe.cluster.generate import generate_cluster
from flexpipe.gateway.config import ConfigError, GatewayConfig, config_from_dict
from flexpipe.gears.gear import Gear, GearError, parse_gear
from flexpipe.model_spec import load_model_spec
from flexpipe.policies.planner import ModelsFileError, PlannerConfig
from flexpipe.policies.shift import ShiftParams
from flexpipe.sim import fields
from flexpipe.sim.controller import ControllerParams
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.start import StartParams, parse_start
from flexpipe.sim.timeline import TimelineError, TimelineEvent, parse_timeline
from flexpipe.sim.trace import TraceReplay
from flexpipe.sim.workload import (
    Bursts,
    Diurnal,
    LengthDist,
    SharedPrefix,
    Synthetic,
    WorkloadError,
)

_KEYS = {
    "name",
    "description",
    "duration_s",
    "seed",
    "policy",
    "cluster",
    "models",
    "workloads",
    "gateway",
    "report_interval_s",
    "resources",
    "controller",
    "plans",
    "planner",
    "start",
}
_CONTROLLER_KEYS = {
    "tick_s",
    "drain_deadline_s",
    "rehearsal_tolerance",
    "min_instances_floor",
    "shift",
}
_WORKLOAD_KEYS = {
    "model",
    "arrivals",
    "diurnal",
    "prompt_tokens",
    "output_tokens",
    "shared_prefix",
    "trace",
}


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
    # the planner's knobs for every policy that plans (`planner: {sizing: slo}`)
    planner: PlannerConfig = field(default_factory=PlannerConfig)
    start: StartParams = field(default_factory=StartParams)  # how the deployment starts


def _mapping(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ScenarioError(f"{where}: expected a mapping")
    return value


_BURST_KEYS = ("off_mean_s", "burst_min_s", "burst_max_s")  # onoff arrivals (workload.Bursts)
_GENERATE_KEYS = ("nodes", "gpus_per_node", "seed")
_CLUSTER_KEYS = ("file", "inline", "generate")
_ARRIVAL_KEYS = ("process", "rate_per_s", "cv", "start_s", *_BURST_KEYS)
_TRACE_KEYS = ("kind", "file", "speedup", "offset_s")
MAX_REPORT_INTERVALS = 1_000_000  # duration_s / report_interval_s: the report's timeline rows
MAX_EXPECTED_REQUESTS = 10_000_000  # generated up front: ~2-3 GB, ~45 CPU minutes
MIN_TICK_S = 0.001  # a finer controller tick would make a run endless, not more exact


def _cluster(value: Any, base: Path, where: str) -> Cluster:
    doc = fields.mapping(value, where)
    given = [k for k in _CLUSTER_KEYS if k in doc]
    fields.check_keys(doc, _CLUSTER_KEYS, where)
    if len(given) != 1:
        raise ScenarioError(f"{where}: give `file`, `inline` or `generate` (exactly one)")
    try:
        if "file" in doc:
            return load_cluster(base / str(doc["file"]))
        if "inline" in doc:
            return parse_cluster(doc["inline"], f"{where}.inline")
        g = fields.mapping(doc["generate"], f"{where}.generate")
        fields.check_keys(g, _GENERATE_KEYS, f"{where}.generate")
        return generate_cluster(
            fields.integer(g.get("nodes", 1), f"{where}.generate.nodes", min_value=1),
            fields.integer(
                g.get("gpus_per_node", 8), f"{where}.generate.gpus_per_node", min_value=1
            ),
            fields.integer(g.get("seed", 0), f"{where}.generate.seed"),
        )
    except ClusterError as exc:
        raise ScenarioError(str(exc).replace("\n", "; ")) from None


def _trace(value: Any, base: Path, where: str) -> TraceReplay:
    t = fields.mapping(value, where)
    fields.check_keys(t, _TRACE_KEYS, where)
    path = base / str(t.get("file", ""))
    if not path.is_file():
        raise ScenarioError(f"{where}: trace file {path} does not exist")
    try:
        replay = TraceReplay(
            kind=str(t.get("kind", "")),
            path=path,
            speedup=fields.number(t.get("speedup", 1.0), f"{where}.speedup"),
            offset_s=fields.number(t.get("offset_s", 0.0), f"{where}.offset_s"),
        )
    except WorkloadError as exc:
        raise ScenarioError(f"{where}.{exc}") from None
    try:
        replay.rows()  # a malformed or empty trace is an error now, not mid-run
    except WorkloadError as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    return replay


def _workload(value: Any, base: Path, where: str, models: list[str]) -> Workload:
    doc = _mapping(value, where)
    unknown = sorted(set(doc) - _WORKLOAD_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    model = doc.get("model", models[0] if len(models) == 1 else None)
    if model not in models:
        raise ScenarioError(f"{where}.model: {model!r} is not one of the models {models}")
    if "trace" in doc:
        return Workload(model, _trace(doc["trace"], base, f"{where}.trace"))
    place = f"{where}.arrivals"
    arrivals = fields.mapping(doc.get("arrivals"), place)
    fields.check_keys(arrivals, _ARRIVAL_KEYS, place)
    if "rate_per_s" not in arrivals:
        raise ScenarioError(f"{place}.rate_per_s: missing (requests per second, > 0)")
    try:
        process = str(arrivals.get("process", "poisson"))
        bursts = None
        if process == "onoff":
            given = {k: arrivals[k] for k in _BURST_KEYS if k in arrivals}
            bursts = fields.build(Bursts, given, place)
        elif any(k in arrivals for k in _BURST_KEYS):
            raise ScenarioError(f"{place}: {', '.join(_BURST_KEYS)} are for process: onoff")
        source = Synthetic(
            rate_per_s=fields.number(arrivals["rate_per_s"], f"{place}.rate_per_s"),
            arrival=process,
            bursts=bursts,
            cv=fields.number(arrivals.get("cv", 1.0), f"{place}.cv"),
            start_s=fields.number(arrivals.get("start_s", 0.0), f"{place}.start_s"),
            prompt=fields.build(LengthDist, doc.get("prompt_tokens", {}), f"{where}.prompt_tokens"),
            output=fields.build(LengthDist, doc.get("output_tokens", {}), f"{where}.output_tokens"),
            diurnal=fields.build(Diurnal, doc["diurnal"], f"{where}.diurnal")
            if "diurnal" in doc
            else None,
            shared_prefix=fields.build(SharedPrefix, doc["shared_prefix"], f"{where}.shared_prefix")
            if "shared_prefix" in doc
            else None,
        )
    except WorkloadError as exc:  # the arrivals' own checks (the others name their place)
        raise ScenarioError(f"{place}.{exc}") from None
    return Workload(model, source)


def _controller(value: Any, where: str) -> ControllerParams:
    doc = dict(_mapping(value or {}, where))
    unknown = sorted(set(doc) - _CONTROLLER_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    try:
        shift_doc = doc.pop("shift", {}) or {}
        shift = ShiftParams.from_mapping(shift_doc)
    except (TypeError, ValueError) as exc:
        raise ScenarioError(f"{where}: {exc}") from None
    if "sleep_mode" not in shift_doc:  # a scenario sleeps only where it says so
        shift = replace(shift, sleep_mode="off")
    d = ControllerParams()
    return ControllerParams(
        tick_s=fields.number(doc.get("tick_s", d.tick_s), f"{where}.tick_s", min_value=MIN_TICK_S),
        drain_deadline_s=fields.number(
            doc.get("drain_deadline_s", d.drain_deadline_s),
            f"{where}.drain_deadline_s",
            min_value=0,
        ),
        rehearsal_tolerance=fields.number(
            doc.get("rehearsal_tolerance", d.rehearsal_tolerance),
            f"{where}.rehearsal_tolerance",
            above=0,
        ),
        min_instances_floor=fields.integer(
            doc.get("min_instances_floor", d.min_instances_floor),
            f"{where}.min_instances_floor",
            min_value=0,
        ),
        shift=shift,
    )


_PLANNER_KEYS = {"sizing", "share_gpus"}


def _planner(value: Any, where: str) -> PlannerConfig:
    doc = _mapping(value or {}, where)
    unknown = sorted(set(doc) - _PLANNER_KEYS)
    if unknown:
        raise ScenarioError(f"{where}: unknown key(s) {', '.join(unknown)}")
    sizing = doc.get("sizing", PlannerConfig().sizing)
    if sizing not in ("throughput", "slo"):
        raise ScenarioError(f"{where}.sizing: use throughput or slo (got {sizing!r})")
    share = doc.get("share_gpus", False)
    if not isinstance(share, bool):
        raise ScenarioError(f"{where}.share_gpus: use true or false (got {share!r})")
    return PlannerConfig(sizing=sizing, share_gpus=share)


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
            built.append(
                Deployment(
                    f"{model}-{name}-{i}",
                    model,
                    ids[model],
                    gear,
                    tuple(tuple(str(g) for g in st) for st in stages),
                )
            )
        out[str(name)] = tuple(built)
    return out


def _admission_from_models(
    gateway: GatewayConfig, models: list[dict[str, Any]], names: list[str]
) -> None:
    """The gateway's deadline-aware admission knows each model's TTFT SLO and priority from
    the scenario's models (as the live gateway's config names them), unless it names them."""
    adm = gateway.admission
    if not adm.enabled:
        return
    for name, m in zip(names, models, strict=True):
        slo = m.get("slo")
        ttft_ms = slo.get("ttft_p99_ms") if isinstance(slo, dict) else None
        if isinstance(ttft_ms, int | float) and ttft_ms > 0:
            adm.ttft_slo_s.setdefault(name, ttft_ms / 1000)
        priority = m.get("priority")
        if isinstance(priority, int | float) and priority > 0:
            adm.priority.setdefault(name, float(priority))


def parse_scenario(doc: Any, base: Path, source: str = "<scenario>") -> Scenario:
    try:
        return _parse(doc, base, source)
    except fields.FieldError as exc:
        raise ScenarioError(str(exc)) from None


def _parse(doc: Any, base: Path, source: str) -> Scenario:
    doc = _mapping(doc, source)
    unknown = sorted(set(doc) - _KEYS)
    if unknown:
        raise ScenarioError(f"{source}: unknown key(s) {', '.join(unknown)}")
    nan = fields.find_nan(doc, "")
    if nan is not None:
        raise ScenarioError(f"{source}: {nan}: expected a number, got nan")
    models = doc.get("models")
    if not isinstance(models, list) or not models or not all(isinstance(m, dict) for m in models):
        raise ScenarioError(f"{source}: `models` must list at least one model")
    names = [str(m.get("name", m.get("model"))) for m in models]
    workloads = doc.get("workloads")
    if not isinstance(workloads, list) or not workloads:
        raise ScenarioError(f"{source}: `workloads` must list at least one workload")
    duration = _duration(doc.get("duration_s"), f"{source}: duration_s")
    try:
        gateway = config_from_dict(_mapping(doc.get("gateway") or {}, f"{source}: gateway"))
    except ConfigError as exc:
        raise ScenarioError(f"{source}: gateway: {exc}") from None
    _admission_from_models(gateway, models, names)
    cluster = _cluster(doc.get("cluster"), base, f"{source}: cluster")
    try:
        resources = parse_timeline(doc.get("resources"), cluster, f"{source}: resources")
    except TimelineError as exc:
        raise ScenarioError(str(exc)) from None
    scenario = Scenario(
        name=str(doc.get("name", source)),
        description=str(doc.get("description", "")),
        cluster=cluster,
        resources=resources,
        controller=_controller(doc.get("controller"), f"{source}: controller"),
        planner=_planner(doc.get("planner"), f"{source}: planner"),
        start=parse_start(doc.get("start"), f"{source}: start"),
        plans=_plans(doc.get("plans"), [dict(m) for m in models], f"{source}: plans"),
        models=[dict(m) for m in models],
        workloads=tuple(
            _workload(w, base, f"{source}: workloads[{i}]", names) for i, w in enumerate(workloads)
        ),
        duration_s=duration,
        seed=fields.integer(doc.get("seed", 0), f"{source}: seed"),
        policy=str(doc.get("policy", "flexpipe")),
        gateway=gateway,
        report_interval_s=fields.number(
            doc.get("report_interval_s", 60.0), f"{source}: report_interval_s", above=0
        ),
    )
    _check_span(scenario, source)
    return scenario


def _duration(value: Any, name: str) -> float:
    """`name` (`FILE: duration_s`, `--duration-s`): a finite number > 0."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not value > 0:
        raise ScenarioError(f"{name} must be a positive number (got {value!r})")
    if not math.isfinite(value):
        raise ScenarioError(f"{name} must be a finite number (got {value!r})")
    return float(value)


def _check_span(sc: Scenario, where: str) -> None:
    """What the duration bounds: the report's intervals and the requests generated up front
    (a run that would not end, or not fit in memory, is refused before it starts)."""
    intervals = sc.duration_s / sc.report_interval_s
    if intervals > MAX_REPORT_INTERVALS:
        raise ScenarioError(
            f"{where}: report_interval_s {sc.report_interval_s:g} cuts duration_s "
            f"{sc.duration_s:g} into {intervals:.3g} intervals (at most {MAX_REPORT_INTERVALS:,})"
        )
    expected = sum(
        w.source.peak_rate_per_s * max(0.0, sc.duration_s - w.source.start_s)
        for w in sc.workloads
        if isinstance(w.source, Synthetic)
    )
    if expected > MAX_EXPECTED_REQUESTS:
        raise ScenarioError(
            f"{where}: the workloads' rate_per_s over duration_s {sc.duration_s:g} s would "
            f"generate ~{expected:.3g} requests (at most {MAX_EXPECTED_REQUESTS:,})"
        )


def with_duration(sc: Scenario, duration_s: float) -> Scenario:
    """The scenario run for `duration_s` instead (`--duration-s`), checked as the file's."""
    scenario = replace(sc, duration_s=_duration(duration_s, "--duration-s"))
    _check_span(scenario, "--duration-s")
    return scenario


def load_scenario(path: str | Path) -> Scenario:
    path = Path(path)
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as exc:
        raise ScenarioError(f"{path}: cannot read the file: {exc.strerror}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
        problem = exc.problem or exc.context or "not YAML"
        raise ScenarioError(f"{path}: {at}YAML syntax error: {problem}") from None
    except yaml.YAMLError as exc:
        raise ScenarioError(f"{path}: YAML syntax error: {' '.join(str(exc).split())}") from None
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
    "with_duration",
]

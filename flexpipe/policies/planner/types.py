"""The planner's inputs and outputs: plain, immutable dataclasses."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION, Gear
from flexpipe.hardware import DEFAULT_FAST_LINK_BYTES_PER_S
from flexpipe.perf.gear_lookup import GearEstimate
from flexpipe.perf.steady_state import Workload

__all__ = [
    "Alternative",
    "Baseline",
    "InstanceChange",
    "ModelDemand",
    "ModelOutcome",
    "Plan",
    "PlannedInstance",
    "PlannerConfig",
    "Slo",
    "UnusedGpu",
    "num_gpus_held",
]


@dataclass(frozen=True, slots=True)
class Slo:
    ttft_p99_s: float
    tpot_p99_s: float

    def __post_init__(self) -> None:
        if self.ttft_p99_s <= 0 or self.tpot_p99_s <= 0:
            raise ValueError("SLOs must be positive")


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """The weights an engine loads to serve one precision (policies/planner/checkpoint.py)."""

    precision: str  # what it runs as (bf16, fp8, int8, int4-awq, ...)
    path: str  # HF repo id or local path
    quantization: str | None  # its method as vLLM's --quantization names it; None: unquantized


@dataclass(frozen=True, slots=True)
class ModelDemand:
    """One model to serve: what clients call it, its shape, its load and its SLOs."""

    name: str  # the served model name clients ask for
    model: str  # model spec id or config.json path (flexpipe.model_spec)
    request_rate_per_s: float
    input_tokens: int  # mean prompt length
    output_tokens: int  # mean completion length
    slo: Slo
    dtypes: tuple[str, ...] = ("bf16",)  # precisions the owner accepts (quality)
    max_model_len: int | None = None  # context the engines are launched with
    # Weight of one of its SLO-meeting requests in the objective (seed 004: a customer-facing
    # model outranks an internal one). 2 means one of its requests counts as two of a 1's.
    priority: float = 1.0
    # Never fewer instances when the GPUs allow it, demand or not (0: may scale to zero).
    min_instances: int = 0
    # The weights real engines load (HF repo id or path; None: the spec's own, `model`) and
    # the quantized checkpoints named per precision (policies/planner/checkpoint.py).
    weights: str | None = None
    checkpoints: tuple[Checkpoint, ...] = ()
    # Precisions the owner accepts that no checkpoint serves: left out of `dtypes`, said by
    # `flexpipe plan`.
    dtypes_without_checkpoint: tuple[str, ...] = ()
    # The arrivals' burstiness: the index of dispersion of their counts (1: Poisson; the
    # measured value where the controller or simulator has one). Read by `sizing: slo` only.
    arrival_cv2: float = 1.0

    def __post_init__(self) -> None:
        if not self.arrival_cv2 > 0:
            raise ValueError(f"{self.name}: arrival_cv2 must be > 0")
        if self.request_rate_per_s < 0:
            raise ValueError(f"{self.name}: request_rate_per_s must be >= 0")
        if not self.priority > 0:
            raise ValueError(f"{self.name}: priority must be > 0")
        if self.min_instances < 0:
            raise ValueError(f"{self.name}: min_instances must be >= 0")
        if self.input_tokens < 1 or self.output_tokens < 1:
            raise ValueError(f"{self.name}: input_tokens and output_tokens must be >= 1")
        if not self.dtypes:
            raise ValueError(f"{self.name}: dtypes must name at least one precision")

    @property
    def workload(self) -> Workload:
        return Workload(self.input_tokens, self.output_tokens)

    @property
    def demand_tokens_per_s(self) -> float:
        """The output tokens per second the demand asks for (what goodput is measured in)."""
        return self.request_rate_per_s * self.output_tokens


@dataclass(frozen=True, slots=True)
class PlannerConfig:
    """Knobs, with the defaults a platform engineer meets first (docs/planner.md)."""

    # Tensor parallelism only over links at least this fast (flexpipe.hardware's default).
    fast_link_bytes_per_s: float = DEFAULT_FAST_LINK_BYTES_PER_S
    max_pp: int = 4
    # Concurrencies (max_num_seqs) tried per placement; the largest that meets the SLOs wins.
    batch_ladder: tuple[int, ...] = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)
    # Instances are loaded to this share of their SLO-meeting capacity (queueing headroom).
    target_utilization: float = 0.85
    # How an instance's capacity is sized: `throughput` (its steady-state requests/s at the
    # largest SLO-meeting concurrency, times `target_utilization`) or `slo` (the arrival rate
    # at which its TTFT and TPOT meet the SLOs under the demand's burstiness, queueing
    # included: flexpipe.perf.slo_capacity; docs/planner.md "Sized at the SLO").
    sizing: Literal["throughput", "slo"] = "throughput"
    # A GPU free only until `free_until_s` is used when at least this much time is left.
    min_lease_s: float = 900.0
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    max_alternatives: int = 6
    # Baselines (one big group, wait for identical GPUs) are computed up to this many GPUs.
    max_baseline_gpus: int = 4
    # Up to this many usable GPUs, the LP's pool holds pipeline chains across nodes (every
    # window of the cluster's groups by free memory); above, chains stay inside a node.
    max_cross_node_gpus: int = 16
    # Up to this many usable GPUs, every set of up to max_pp groups (a chain ordered by free
    # memory) is in the LP's pool: tiny clusters get a near-exhaustive search.
    max_subset_gpus: int = 10
    # Price rounds: greedy passes; after each, the models it covered are priced down by
    # `price_step` while others are short (docs/planner.md).
    price_rounds: int = 1
    price_step: float = 0.5
    # Stickiness (`plan(..., running=...)`): a running instance that still fits its GPUs is
    # replaced only when the switch raises the plan's priority-weighted goodput by more than
    # this fraction of what the replaced instances serve now (the shift policy's resource
    # trigger asks 2% of the running plan's goodput too, and prices the move itself).
    replace_margin: float = 0.02
    # Memory sharing (docs/gpu-sharing.md): after planning, single-GPU instances of models that
    # need far less than one GPU are packed two or more to a GPU, each engine launched with
    # its own memory fraction, priced with the GPU's time-slicing (flexpipe.perf.colocation).
    share_gpus: bool = False

    def __post_init__(self) -> None:
        if not 0 < self.target_utilization <= 1:
            raise ValueError("target_utilization must be in (0, 1]")
        if self.sizing not in ("throughput", "slo"):
            raise ValueError(f"sizing must be throughput or slo (got {self.sizing!r})")
        if self.replace_margin < 0:
            raise ValueError("replace_margin must be >= 0")
        if self.max_pp < 1 or not self.batch_ladder or min(self.batch_ladder) < 1:
            raise ValueError("max_pp and batch sizes must be >= 1")


@dataclass(frozen=True, slots=True)
class Alternative:
    """A choice the planner did not make, and why (with numbers)."""

    description: str  # "tp=1 on gpu1" / "tp=2 over gpu2+gpu3 (across eth25)"
    gpu_ids: tuple[str, ...]
    tokens_per_s_per_gpu: float | None  # SLO-meeting output tokens/s per GPU; None: cannot run
    reason: str


@dataclass(frozen=True, slots=True)
class PlannedInstance:
    name: str  # "<model name>-<n>"
    model: str  # the demand's served name
    model_id: str  # the model spec id
    gear: Gear  # max_num_seqs = the chosen concurrency
    stages: tuple[tuple[str, ...], ...]  # GPU ids per pipeline stage (TP group)
    layers_per_stage: tuple[int, ...]
    estimate: GearEstimate  # at gear.max_num_seqs
    capacity_tokens_per_s: float  # SLO-meeting output tokens/s at target utilisation
    capacity_requests_per_s: float
    assigned_requests_per_s: float  # the share of the demand routed here
    kv_capacity_tokens: int
    max_concurrency: int  # sequences of full context whose KV fits
    why: str
    alternatives: tuple[Alternative, ...] = ()
    # Shares its GPU with other instances (`share_gpus`): its engine's
    # `--gpu-memory-utilization`, a fraction of the GPU's whole memory. None: the GPU is its
    # own (the planner's `gpu_memory_utilization`).
    gpu_memory_fraction: float | None = None

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return tuple(g for s in self.stages for g in s)

    @property
    def num_gpus(self) -> int:
        return len(self.gpu_ids)


def num_gpus_held(instances: Iterable[PlannedInstance]) -> int:
    """GPUs the instances hold: each instance's own, plus each GPU shared in memory
    (`gpu_memory_fraction`) once, however many instances share it."""
    own = 0
    shared: set[str] = set()
    for i in instances:
        if i.gpu_memory_fraction is None:
            own += i.num_gpus
        else:
            shared.update(i.gpu_ids)
    return own + len(shared)


@dataclass(frozen=True, slots=True)
class ModelOutcome:
    name: str
    demand_tokens_per_s: float
    served_tokens_per_s: float  # served requests/s x output tokens
    capacity_tokens_per_s: float
    num_instances: int
    num_gpus: int
    priority: float = 1.0
    min_instances: int = 0
    demand_requests_per_s: float = 0.0
    served_requests_per_s: float = 0.0  # min(demand, SLO-meeting capacity): goodput
    capacity_requests_per_s: float = 0.0

    @property
    def covered(self) -> bool:
        return self.served_requests_per_s >= self.demand_requests_per_s * (1 - 1e-9)

    @property
    def weighted_goodput_per_s(self) -> float:
        """This model's term of the objective: priority x SLO-meeting requests/s."""
        return self.priority * self.served_requests_per_s

    @property
    def below_minimum(self) -> bool:
        return self.num_instances < self.min_instances


ChangeStatus = Literal["kept", "new", "stopped"]


@dataclass(frozen=True, slots=True)
class InstanceChange:
    """One line of the diff from the running plan (`plan(..., running=...)`) to this one:
    what the controller does with the instance called `name`."""

    name: str
    status: ChangeStatus  # kept: leave it running; new: start it; stopped: drain and stop it
    reason: str


@dataclass(frozen=True, slots=True)
class UnusedGpu:
    gpu_id: str
    reason: str


@dataclass(frozen=True, slots=True)
class Baseline:
    """A plan the planner compares itself with (e.g. one big group, or waiting for identical
    GPUs), with its SLO-meeting throughput now."""

    name: str
    description: str
    goodput_tokens_per_s: float
    detail: str


@dataclass(frozen=True)
class Plan:
    instances: tuple[PlannedInstance, ...]
    models: tuple[ModelOutcome, ...]
    unused: tuple[UnusedGpu, ...] = ()
    baselines: tuple[Baseline, ...] = ()
    notes: tuple[str, ...] = field(default=())
    # The diff from the running plan: one entry per instance of this plan (kept or new) and
    # per running instance it stops, in that order. Without a running plan, all are new.
    changes: tuple[InstanceChange, ...] = ()
    stopped: tuple[PlannedInstance, ...] = ()  # running instances this plan does not keep

    @property
    def weighted_goodput_per_s(self) -> float:
        """The objective: sum over models of priority x SLO-meeting requests/s."""
        return sum(m.weighted_goodput_per_s for m in self.models)

    @property
    def goodput_requests_per_s(self) -> float:
        """SLO-meeting requests/s of the demand, unweighted."""
        return sum(m.served_requests_per_s for m in self.models)

    @property
    def goodput_tokens_per_s(self) -> float:
        """SLO-meeting output tokens/s of the demand (served requests x output tokens)."""
        return sum(m.served_tokens_per_s for m in self.models)

    def status_of(self, name: str) -> ChangeStatus:
        for c in self.changes:
            if c.name == name:
                return c.status
        raise KeyError(name)

    @property
    def kept(self) -> tuple[PlannedInstance, ...]:
        keep = {c.name for c in self.changes if c.status == "kept"}
        return tuple(i for i in self.instances if i.name in keep)

    @property
    def new(self) -> tuple[PlannedInstance, ...]:
        keep = {c.name for c in self.changes if c.status == "kept"}
        return tuple(i for i in self.instances if i.name not in keep)

    @property
    def capacity_tokens_per_s(self) -> float:
        return sum(i.capacity_tokens_per_s for i in self.instances)

    @property
    def num_gpus(self) -> int:
        return num_gpus_held(self.instances)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (`flexpipe plan --json`)."""
        return {
            "weighted_goodput_per_s": self.weighted_goodput_per_s,
            "goodput_requests_per_s": self.goodput_requests_per_s,
            "goodput_tokens_per_s": self.goodput_tokens_per_s,
            "num_gpus": self.num_gpus,
            "models": [
                {
                    "name": m.name,
                    "priority": m.priority,
                    "min_instances": m.min_instances,
                    "demand_requests_per_s": m.demand_requests_per_s,
                    "served_requests_per_s": m.served_requests_per_s,
                    "capacity_requests_per_s": m.capacity_requests_per_s,
                    "demand_tokens_per_s": m.demand_tokens_per_s,
                    "served_tokens_per_s": m.served_tokens_per_s,
                    "capacity_tokens_per_s": m.capacity_tokens_per_s,
                    "covered": m.covered,
                    "num_instances": m.num_instances,
                    "num_gpus": m.num_gpus,
                }
                for m in self.models
            ],
            "instances": [
                {
                    "name": i.name,
                    "model": i.model,
                    "model_id": i.model_id,
                    "gear": str(i.gear),
                    "gear_key": i.gear.key(),
                    "stages": [list(s) for s in i.stages],
                    "layers_per_stage": list(i.layers_per_stage),
                    "batch": i.estimate.batch,
                    "output_tokens_per_s": i.estimate.output_tokens_per_s,
                    "capacity_tokens_per_s": i.capacity_tokens_per_s,
                    "capacity_requests_per_s": i.capacity_requests_per_s,
                    "assigned_requests_per_s": i.assigned_requests_per_s,
                    "ttft_s": i.estimate.ttft_s,
                    "tpot_s": i.estimate.tpot_s,
                    "e2e_s": i.estimate.e2e_s,
                    "basis": i.estimate.basis,
                    "detail": i.estimate.detail,
                    "kv_capacity_tokens": i.kv_capacity_tokens,
                    "max_concurrency": i.max_concurrency,
                    **(
                        {"gpu_memory_fraction": i.gpu_memory_fraction}
                        if i.gpu_memory_fraction is not None
                        else {}
                    ),
                    "why": i.why,
                    "alternatives": [
                        {
                            "description": a.description,
                            "gpu_ids": list(a.gpu_ids),
                            "tokens_per_s_per_gpu": a.tokens_per_s_per_gpu,
                            "reason": a.reason,
                        }
                        for a in i.alternatives
                    ],
                }
                for i in self.instances
            ],
            "changes": [
                {"name": c.name, "status": c.status, "reason": c.reason} for c in self.changes
            ],
            "stopped": [i.name for i in self.stopped],
            "unused": [{"gpu_id": u.gpu_id, "reason": u.reason} for u in self.unused],
            "baselines": [
                {
                    "name": b.name,
                    "description": b.description,
                    "goodput_tokens_per_s": b.goodput_tokens_per_s,
                    "detail": b.detail,
                }
                for b in self.baselines
            ],
            "notes": list(self.notes),
        }

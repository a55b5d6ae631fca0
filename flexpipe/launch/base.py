"""The one launcher interface: "start an engine for this gear on these GPUs, give me its
endpoint". gear_bench, `flexpipe up` and the controller all go through it: local processes
(local.py) and Ray actors in placement groups across nodes (ray.py) implement it.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from flexpipe.gears.gear import DEFAULT_GPU_MEMORY_UTILIZATION, Gear

if TYPE_CHECKING:
    from flexpipe.store.instance_registry import InstanceRecord


class LaunchError(RuntimeError):
    """An engine that could not be started; the message says why in one paragraph
    (with the last lines of the engine's log)."""


class EngineNotReady(LaunchError):
    """The engine did not answer /health 200 within the timeout (it has been stopped)."""


class EngineExited(LaunchError):
    """The engine process exited (before ready, or while in use)."""

    def __init__(self, message: str, returncode: int | None) -> None:
        super().__init__(message)
        self.returncode = returncode


@dataclass(frozen=True, slots=True)
class GpuPlace:
    """One GPU of an instance, where it is: its cluster id, its node, its device index there
    (CUDA_VISIBLE_DEVICES on that node) and its catalog type."""

    gpu_id: str
    node: str
    index: int
    type: str


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """What to run and where. GPUs are named two ways: cluster ids (`gpu_ids`, the sim
    engine uses them with `cluster_file` to know what it stands for) and device indices on the
    host (`gpu_indices`, vLLM's CUDA_VISIBLE_DEVICES).

    `placement` and `topology` carry the placement itself, for launchers whose engines run on
    other machines (Ray): each GPU's node and index, and the placement's GPUs and links as a
    cluster document (YAML), which a sim engine on a worker node reads instead of a file that
    only the controller's machine has."""

    model: str  # the model spec id (what the sim engine stands for)
    gear: Gear = field(default_factory=Gear)
    name: str = "engine"  # instance name, for logs
    gpu_ids: tuple[str, ...] = ()  # cluster GPU ids in pipeline order, tp per stage
    gpu_indices: tuple[int, ...] = ()  # CUDA_VISIBLE_DEVICES
    cluster_file: str | None = None
    gpu_type: str = "A100-80G-SXM"  # sim without a cluster file: every rank this type
    link: str = "nvlink3"
    pp_link: str | None = None
    served_model_name: str | None = None
    max_model_len: int | None = None
    gpu_memory_utilization: float = DEFAULT_GPU_MEMORY_UTILIZATION
    extra_args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()  # extra environment (VLLM_PP_LAYER_PARTITION)
    placement: tuple[GpuPlace, ...] = ()  # the GPUs in pipeline order, tp per stage
    topology: str | None = None  # cluster YAML of just the placement's GPUs and links
    # What real engines load for the gear's precision (HF repo id or path; None: the catalog's
    # repo id of `model`), and its quantization method as vLLM names it (None: unquantized, or
    # fp8 made from bf16 weights as they load). policies/planner/checkpoint.py chooses them.
    weights: str | None = None
    quantization: str | None = None
    enable_sleep_mode: bool = False  # vLLM: serve /sleep and /wake_up (engine_kinds.py)


@runtime_checkable
class EngineHandle(Protocol):
    """A started engine. `endpoint` is its base URL (`http://127.0.0.1:8001`)."""

    @property
    def name(self) -> str: ...

    @property
    def endpoint(self) -> str: ...

    @property
    def cold_start_s(self) -> float:
        """Wall seconds from launch to /health 200."""
        ...

    @property
    def returncode(self) -> int | None:
        """None while running; the exit status once it has exited."""
        ...

    async def stop(self) -> None:
        """Stop the engine and everything it started (idempotent)."""
        ...


class HandleBase(abc.ABC):
    """What the EngineHandle implementations share: a name, an endpoint, the seconds the
    engine took to become ready (set by its launcher) and a stop that runs once."""

    def __init__(self, name: str, endpoint: str, cold_start_s: float = 0.0) -> None:
        self._name = name
        self._endpoint = endpoint
        self._cold_start_s = cold_start_s
        self._stopped = False

    @property
    def name(self) -> str:
        return self._name

    @property
    def endpoint(self) -> str:
        return self._endpoint

    @property
    def cold_start_s(self) -> float:
        return self._cold_start_s

    async def stop(self) -> None:
        """Stop the engine and everything it started (idempotent)."""
        if self._stopped:
            return
        self._stopped = True
        await self._stop()

    @abc.abstractmethod
    async def _stop(self) -> None:
        """Stop this kind of engine (called once)."""


class Launcher(Protocol):
    async def start(self, spec: EngineSpec) -> EngineHandle:
        """Start an engine and return once it answers /health 200. Raises LaunchError
        (EngineNotReady, EngineExited), leaving nothing running."""
        ...


class AdoptingLauncher(Launcher, Protocol):
    """A launcher whose engines may outlive the controller that started them (the
    controller's takeover after a restart, control/engines/takeover.py, asks it for them)."""

    async def adopt(self, records: Sequence[InstanceRecord]) -> Mapping[int, EngineHandle]:
        """Handles on the engines of `records` (the store's live instances after a
        controller restart) that still run, by record id; their /health is the caller's
        to ask. Whatever else of this launcher's a previous controller left, it removes."""
        ...

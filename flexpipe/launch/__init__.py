"""Engine launchers: one interface (`Launcher.start(EngineSpec) -> EngineHandle`), a
local-process implementation for the sim engine and vLLM, and a Ray one (launch/ray_launcher.py,
imported on its own: Ray is an optional extra)."""

from flexpipe.launch.base import (
    AdoptingLauncher,
    EngineExited,
    EngineHandle,
    EngineNotReady,
    EngineSpec,
    GpuPlace,
    Launcher,
    LaunchError,
)
from flexpipe.launch.command import ENGINES, vllm_flags
from flexpipe.launch.local import AdoptedEngine, LocalEngine, LocalLauncher
from flexpipe.launch.process import free_port

__all__ = [
    "ENGINES",
    "AdoptedEngine",
    "AdoptingLauncher",
    "EngineExited",
    "EngineHandle",
    "EngineNotReady",
    "EngineSpec",
    "GpuPlace",
    "LaunchError",
    "Launcher",
    "LocalEngine",
    "LocalLauncher",
    "free_port",
    "vllm_flags",
]

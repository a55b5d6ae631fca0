"""Engine launchers: one interface (`Launcher.start(EngineSpec) -> EngineHandle`), a
local-process implementation for the sim engine and vLLM, and a Ray one (launch/ray.py,
imported on its own: Ray is an optional extra)."""

from flexpipe.launch.base import (
    EngineExited,
    EngineHandle,
    EngineNotReady,
    EngineSpec,
    GpuPlace,
    Launcher,
    LaunchError,
)
from flexpipe.launch.local import ENGINES, LocalEngine, LocalLauncher, free_port, vllm_flags

__all__ = [
    "ENGINES",
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

"""Engine launchers: one interface (`Launcher.start(EngineSpec) -> EngineHandle`), a
local-process implementation for the sim engine and vLLM."""

from flexpipe.launch.base import (
    EngineExited,
    EngineHandle,
    EngineNotReady,
    EngineSpec,
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
    "LaunchError",
    "Launcher",
    "LocalEngine",
    "LocalLauncher",
    "free_port",
    "vllm_flags",
]

"""`flexpipe controller --ray ADDRESS`: the inventory and the launcher of a Ray cluster
(docs/ray.md), assembled in one place for the controller's CLI and `flexpipe up`."""

from __future__ import annotations

from pathlib import Path

from flexpipe.cluster import load_cluster
from flexpipe.cluster.ray_inventory import read_ray_cluster
from flexpipe.control.watch.ray_watch import RayWatch
from flexpipe.launch.ray_launcher import RayLauncher

__all__ = ["ray_backend"]


def ray_backend(
    address: str,
    overlay_path: Path | None,
    deployment: str,
    engine: str,
    time_scale: float,
    sim_load_time_s: float | None,
    ready_timeout_s: float,
    vllm_command: str,
    engine_host: str | None,
) -> tuple[RayWatch, RayLauncher]:
    """The Ray inventory (a watch over it: nodes joining and leaving are resource events) and
    the launcher. `overlay_path`: a cluster file for links and names, read once."""
    overlay = load_cluster(overlay_path) if overlay_path is not None else None
    watch = RayWatch(lambda: read_ray_cluster(address, overlay, deployment=deployment))
    launcher = RayLauncher(
        address,
        engine,
        deployment=deployment,
        time_scale=time_scale,
        sim_load_time_s=sim_load_time_s,
        ready_timeout_s=ready_timeout_s,
        vllm_command=vllm_command.split(),
        engine_host=engine_host,
    )
    return watch, launcher

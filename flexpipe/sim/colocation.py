"""Sim engines that share a GPU in memory slow each other down (docs/gpu-sharing.md).

Engines of planned instances with a memory fraction (`Deployment.gpu_memory_fraction`) join
the run's `Colocation`. When one of them starts a step, its step takes
`flexpipe.perf.colocation.stretch(k)` times the performance model's time, `k` the number of
engines on its GPUs computing a step then, itself included: the driver time-slices the GPU
between their contexts. The factor is taken at the step's start; a neighbour that starts or
stops during the step changes the next one (steps are milliseconds long). Engines alone on
their GPUs never join, so runs without sharing are untouched. An engine released leaves, so a
long run that packs and unpacks many times keeps only the engines that still hold GPUs.
"""

from __future__ import annotations

from typing import Protocol

from flexpipe.perf.colocation import stretch

__all__ = ["Colocation", "Tenant"]


class Tenant(Protocol):
    """What the colocation asks of an engine: its GPUs, and whether a step is in progress."""

    @property
    def gpu_ids(self) -> tuple[str, ...]: ...

    @property
    def computing(self) -> bool: ...


class Colocation:
    """The engines of one run that share GPUs, by GPU."""

    def __init__(self) -> None:
        self._by_gpu: dict[str, list[Tenant]] = {}  # GPU id -> engines on it (joined order)

    def join(self, tenant: Tenant) -> None:
        for g in tenant.gpu_ids:
            self._by_gpu.setdefault(g, []).append(tenant)

    def leave(self, tenant: Tenant) -> None:
        for g in tenant.gpu_ids:
            left = [t for t in self._by_gpu.get(g, ()) if t is not tenant]
            if left:
                self._by_gpu[g] = left
            else:
                self._by_gpu.pop(g, None)

    def num_tenants(self, gpu_id: str) -> int:
        return len(self._by_gpu.get(gpu_id, ()))

    def factor(self, tenant: Tenant) -> float:
        """How much longer `tenant`'s step starting now takes: `stretch(k)`."""
        busy = {
            id(t): t
            for g in tenant.gpu_ids
            for t in self._by_gpu.get(g, ())
            if t is not tenant and t.computing
        }
        return stretch(1 + len(busy))

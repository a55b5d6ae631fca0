"""A restarted controller takes over the engines its predecessor left running (docs/controller.md,
"Crash safety"): the store's registry says which instances were live; the launcher says which of
them still run (`AdoptingLauncher.adopt`: a local process group alive, a Ray placement group whole
with its actor alive) and hands back a handle on each; those whose /health answers 200 are adopted
as they are — no duplicate launch —, the others are stopped and marked gone. Each adopted engine
says what share of its GPU's memory it was launched with (`memory_fractions`), so that one that
shares its GPU comes back with its fraction (docs/gpu-sharing.md)."""

from __future__ import annotations

import asyncio
import re
from collections.abc import Mapping

from flexpipe.http.client import ClientPool, Timeouts, UpstreamError
from flexpipe.launch import EngineHandle
from flexpipe.launch.health import health_ok

__all__ = ["healthy", "memory_fractions", "reported_fraction"]

# vLLM exposes its CacheConfig as the labels of one info gauge (CacheConfig.metrics_info: every
# field, `gpu_memory_utilization` among them); the sim engine exposes the same labels.
_CACHE_INFO = re.compile(r"^vllm:cache_config_info\{([^}]*)\}", re.MULTILINE)
_FRACTION = re.compile(r'(?:^|,)gpu_memory_utilization="([^"]*)"')


async def healthy(handles: Mapping[int, EngineHandle], timeout_s: float = 3.0) -> set[int]:
    """The ids (record ids) of the handles whose engine answers GET /health 200."""
    pool = ClientPool(max_idle_per_backend=1)
    timeouts = Timeouts(timeout_s, timeout_s, 1.0)
    try:
        flags = await asyncio.gather(
            *(health_ok(pool, h.endpoint, timeouts) for h in handles.values())
        )
    finally:
        await pool.close()
    return {i for i, good in zip(handles, flags, strict=True) if good}


def reported_fraction(metrics_text: str) -> float | None:
    """The `--gpu-memory-utilization` an engine runs with, from its /metrics text
    (`vllm:cache_config_info`'s `gpu_memory_utilization` label); None when it does not say."""
    info = _CACHE_INFO.search(metrics_text)
    found = _FRACTION.search(info.group(1)) if info else None
    if found is None:
        return None
    try:
        return float(found.group(1))
    except ValueError:
        return None


async def memory_fractions(
    handles: Mapping[int, EngineHandle], timeout_s: float = 3.0
) -> dict[int, float]:
    """Record id -> the memory fraction each engine reports on GET /metrics (those that
    answer and say; `reported_fraction`)."""
    pool = ClientPool(max_idle_per_backend=1)
    timeouts = Timeouts(timeout_s, timeout_s, 1.0)

    async def one(endpoint: str) -> float | None:
        try:
            resp = await pool.request(endpoint, "GET", "/metrics", timeouts=timeouts)
            body = await resp.read()
            resp.release()
        except (UpstreamError, OSError):
            return None
        return reported_fraction(body.decode("utf-8", "replace")) if resp.status == 200 else None

    try:
        values = await asyncio.gather(*(one(h.endpoint) for h in handles.values()))
    finally:
        await pool.close()
    return {i: v for i, v in zip(handles, values, strict=True) if v is not None}

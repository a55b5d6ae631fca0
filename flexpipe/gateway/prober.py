"""Producers of instance state, on the real clock: active health probes (eject with backoff,
re-admit when healthy), metrics scraping of the engines' /metrics (vLLM names, and the
engine's capacity: `flexpipe:max_num_seqs`, `vllm:cache_config_info`), and model discovery
from /v1/models. Every call carries the instance's API key, as requests do (vLLM's
`--api-key` guards /v1/*). Scorers never call these; they read what these wrote."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING

import orjson

from flexpipe.gateway.pool import Instance, Pool
from flexpipe.http.client import Timeouts, UpstreamError
from flexpipe.lifecycle import State

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway

log = logging.getLogger("flexpipe.gateway")

_PROBE_TIMEOUTS = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)

# vLLM metric name -> Instance field (older vLLM spells the KV one gpu_cache_usage_perc)
_METRICS = {
    b"vllm:num_requests_running": "num_running",
    b"vllm:num_requests_waiting": "num_waiting",
    b"vllm:kv_cache_usage_perc": "kv_usage",
    b"vllm:gpu_cache_usage_perc": "kv_usage",
    b"flexpipe:num_tokens_queued_running": "num_tokens",  # the sim engine's exact count
    b"flexpipe:max_num_seqs": "max_num_seqs",  # the sim engine's scheduler limit
}
_CACHE_INFO = b"vllm:cache_config_info"
_LABEL = re.compile(rb'(\w+)="([^"]*)"')


def parse_engine_metrics(text: bytes) -> dict[str, float]:
    """Sum the samples of the metrics routing needs over all their label sets; the KV cache's
    size in tokens (`num_kv_tokens`) from vllm:cache_config_info's labels."""
    out: dict[str, float] = {}
    for line in text.split(b"\n"):
        if not line.startswith((b"vllm:", b"flexpipe:")):
            continue
        name_end = min(i for i in (line.find(b"{"), line.find(b" ")) if i >= 0)
        field = _METRICS.get(line[:name_end])
        if field is None:
            if line[:name_end] == _CACHE_INFO:
                labels = dict(_LABEL.findall(line))
                with contextlib.suppress(KeyError, ValueError):
                    blocks = int(labels[b"num_gpu_blocks"]) * int(labels[b"block_size"])
                    out["num_kv_tokens"] = out.get("num_kv_tokens", 0.0) + blocks
            continue
        try:
            value = float(line.rsplit(b" ", 1)[1])
        except (ValueError, IndexError):
            continue
        out[field] = out.get(field, 0.0) + value
    return out


def apply_engine_metrics(
    pool: Pool, inst: Instance, values: Mapping[str, float], mean_request_tokens: float, now: float
) -> None:
    """One scrape's engine counts (`parse_engine_metrics`' fields) into the routing record, and
    the capacity the engine reports into the pool. Pure: the simulator calls it too."""
    inst.num_running = int(values.get("num_running", 0))
    inst.num_waiting = int(values.get("num_waiting", 0))
    inst.kv_usage = values.get("kv_usage", 0.0)
    if "num_tokens" in values:
        inst.num_scraped_tokens = values["num_tokens"]
    else:  # vLLM: estimate from the request counts
        inst.num_scraped_tokens = (inst.num_running + inst.num_waiting) * mean_request_tokens
    inst.num_tokens_sent_since_scrape = 0.0
    inst.scraped_at_s = now
    pool.report_capacity(
        inst,
        int(values.get("max_num_seqs", 0)),
        int(values.get("num_kv_tokens", 0)),
        mean_request_tokens,
    )


class Prober:
    def __init__(self, gateway: Gateway) -> None:
        self.gw = gateway
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        await asyncio.gather(
            *(self.discover(i) for i in self.gw.pool.instances.values() if i.model is None)
        )
        await asyncio.gather(*(self.scrape(i) for i in self.gw.pool.instances.values()))
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._every(self.gw.cfg.health_interval_s, self.probe)),
            loop.create_task(self._every(self.gw.cfg.scrape_interval_s, self.scrape)),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._tasks = []

    async def _every(self, interval_s: float, fn: object) -> None:
        assert callable(fn)
        while True:
            await asyncio.sleep(interval_s)
            instances = list(self.gw.pool.instances.values())
            try:
                await asyncio.gather(*(fn(i) for i in instances))
            except Exception:  # a bug here must not stop the loop
                log.exception("prober loop failed")

    async def _get(self, inst: Instance, path: str) -> tuple[int, bytes]:
        headers = {"authorization": f"Bearer {inst.api_key}"} if inst.api_key else None
        resp = await self.gw.client.request(
            inst.url, "GET", path, headers=headers, timeouts=_PROBE_TIMEOUTS
        )
        try:
            return resp.status, await resp.read()
        finally:
            resp.release()

    async def discover(self, inst: Instance) -> bool:
        """Fill in the model an instance serves from its /v1/models."""
        try:
            status, body = await self._get(inst, "/v1/models")
            data = orjson.loads(body)["data"] if status == 200 else []
            if data:
                inst.model = str(data[0]["id"])
                return True
        except (UpstreamError, orjson.JSONDecodeError, KeyError, TypeError, IndexError):
            pass
        if inst.healthy:
            self.gw.eject(inst)  # unknown model: not routable until a probe succeeds
        return False

    async def probe(self, inst: Instance) -> None:
        now = self.gw.clock()
        if not inst.healthy and now < inst.ejected_until_s:
            return
        try:
            status, _ = await self._get(inst, "/health")
            ok = status == 200
        except UpstreamError:
            ok = False
        if inst.state is State.GONE:  # removed while the probe ran
            return
        if ok:
            if not inst.healthy:
                if inst.model is None and not await self.discover(inst):
                    return
                await self.scrape(inst)
                self.gw.pool.readmit(inst)
                log.warning("re-admitted %s", inst.url)
            inst.num_consecutive_failures = 0
            return
        inst.num_consecutive_failures += 1
        if not inst.healthy:
            self.gw.eject(inst)  # still down: back off longer
        elif inst.num_consecutive_failures >= self.gw.cfg.eject_after_failures:
            self.gw.eject(inst)

    async def scrape(self, inst: Instance) -> None:
        if not inst.healthy:
            return
        try:
            status, body = await self._get(inst, "/metrics")
        except UpstreamError:
            return  # the probe decides about health; stale metrics count as saturated
        if status != 200:
            return
        values = parse_engine_metrics(body)
        apply_engine_metrics(
            self.gw.pool, inst, values, self.gw.mean_request_tokens, self.gw.clock()
        )

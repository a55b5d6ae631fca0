"""Producers of instance state, on the real clock: active health probes (eject with backoff,
re-admit when healthy), metrics scraping of the engines' /metrics (vLLM names, and the
engine's capacity: `flexpipe:max_num_seqs`, `vllm:cache_config_info`), and model discovery
from /v1/models. Every call carries the instance's API key, as requests do (vLLM's
`--api-key` guards /v1/*). Scorers never call these; they read what these wrote."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import TYPE_CHECKING

import orjson

from flexpipe.gateway.core.engine_metrics import apply_engine_metrics, parse_engine_metrics
from flexpipe.gateway.core.pool import Instance
from flexpipe.http.client import Timeouts, UpstreamError
from flexpipe.lifecycle import State

if TYPE_CHECKING:
    from flexpipe.gateway.app import Gateway

log = logging.getLogger("flexpipe.gateway")

_PROBE_TIMEOUTS = Timeouts(connect_s=1.0, ttfb_s=2.0, idle_s=2.0)


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

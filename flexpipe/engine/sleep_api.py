"""vLLM's sleep mode on the sim engine's HTTP API (docs/sim-engine.md, "Sleep mode"):
POST /sleep?level=0|1|2&mode=abort|wait|keep, POST /wake_up[?tags=...], GET /is_sleeping
(mounted with VLLM_SERVER_DEV_MODE=1, as vLLM mounts them), and the token-protected
GET /admin/sleep the controller reads for its accounting. Sleeps and wake-ups run one at a
time; each takes the performance model's time (`SleepState`), scaled as the engine's steps."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from flexpipe.engine.args import EngineConfig
from flexpipe.engine.runner import Engine
from flexpipe.engine.scheduler import Scheduler
from flexpipe.engine.sleep import MODES, SleepState
from flexpipe.http.server import HttpError, Request, Response, json_response
from flexpipe.perf.model import SLEEP_LEVELS

__all__ = ["SleepApi"]


class SleepApi:
    """The sleep endpoints of one sim engine, over its engine loop and scheduler."""

    def __init__(
        self,
        cfg: EngineConfig,
        engine: Engine,
        scheduler: Scheduler,
        check_admin: Callable[[Request], None],
    ) -> None:
        self.cfg = cfg
        self.engine = engine
        self.scheduler = scheduler
        self.check_admin = check_admin
        self.state = SleepState(cfg.pm, cfg.weight_source)
        self._lock = asyncio.Lock()  # one sleep or wake-up at a time

    def _check_sleep_mode(self) -> None:
        if not self.cfg.enable_sleep_mode:
            raise HttpError(400, "sleep mode is not enabled: start with --enable-sleep-mode")

    async def sleep(self, req: Request) -> Response:
        """POST /sleep?level=0|1|2&mode=abort|wait|keep: an empty 200 once asleep."""
        self._check_sleep_mode()
        params = req.query_params()
        level_text = params.get("level", ["1"])[-1]
        try:
            level = int(level_text)
        except ValueError:
            level = -1
        if level not in SLEEP_LEVELS:
            raise HttpError(400, f"level must be 0, 1 or 2, got {level_text!r}", param="level")
        mode = params.get("mode", ["abort"])[-1]
        if mode not in MODES:
            raise HttpError(400, f"mode must be one of {', '.join(MODES)}", param="mode")
        async with self._lock:
            state = self.state
            if state.is_sleeping:
                return Response(b"")  # already asleep: a no-op, as in vLLM
            tags, duration_s = state.sleep_plan(level)
            state.paused = True  # is_sleeping from here on, as vLLM pauses its scheduler first
            engine = self.engine
            engine.pause(hold_new=True, stop_steps=mode != "wait")
            if mode == "abort":
                for ereq in list(engine.requests.values()):
                    if not ereq.is_finished:
                        engine.abort(ereq)
            elif mode == "wait":
                await engine.drained()
                engine.pause(hold_new=True, stop_steps=True)
            if level >= 1:
                # the KV cache goes: running requests recompute after the wake-up (keep mode)
                self.scheduler.preempt_all()
                self.scheduler.bm.reset_prefix_cache()
            await self._modelled_wait(duration_s)
            state.apply_sleep(level, tags, duration_s)
        return Response(b"")

    async def wake_up(self, req: Request) -> Response:
        """POST /wake_up[?tags=weights][&tags=kv_cache]: an empty 200 once the tags are back;
        scheduling resumes when nothing is asleep any more."""
        self._check_sleep_mode()
        given = req.query_params().get("tags")
        tags = tuple(given) if given else None
        async with self._lock:
            state = self.state
            if not state.is_sleeping:
                return Response(b"")  # awake: a no-op
            waking, duration_s = state.wake_plan(tags)
            await self._modelled_wait(duration_s)
            state.apply_wake(waking, duration_s)
            if not state.is_sleeping:
                self.engine.resume()
        return Response(b"")

    async def is_sleeping(self, req: Request) -> Response:
        return json_response({"is_sleeping": self.state.is_sleeping})

    async def admin_sleep(self, req: Request) -> Response:
        """The sleep state and the memory the engine holds (for the controller's accounting)."""
        self.check_admin(req)
        return json_response(
            {
                "enable_sleep_mode": self.cfg.enable_sleep_mode,
                **self.state.as_dict(),
                "num_held_requests": self.engine.num_held,
            }
        )

    async def _modelled_wait(self, duration_s: float) -> None:
        if duration_s > 0 and self.cfg.time_scale > 0:
            await asyncio.sleep(duration_s * self.cfg.time_scale)

"""The async engine loop: the engine core on the wall clock, with sleeps around its steps.

`EngineCore` (flexpipe.engine.core) decides everything: `plan = core.step(now)`, then this loop
sleeps `plan.duration_s * time_scale`, then `events = core.complete(plan, now)` and hands the
events to the metrics and to each request's consumer. A simulator drives the same core on a
virtual clock.

Timing is kept against an absolute deadline: each step's modelled time (times `time_scale`)
is added to the previous deadline and the loop sleeps until then, so the loop's own overhead
(scheduling, HTTP writes) is absorbed instead of adding up; the deadline restarts when the
engine goes idle. At `time_scale == 0` nothing sleeps: the loop runs up to `max_steps_per_pass`
steps (or MAX_PASS_S of work) between two yields to the event loop, and each stream gets its
tokens of the pass in one write, one SSE event per token (writes, not steps, are the cost
there); new requests are admitted at the next pass.

Consumers are told of progress (new tokens, or the end) in one of two ways:
- `req.sink` (the API's streams: `flexpipe.engine.stream`): the loop calls
  `sink.on_progress(req)` right after the step, and the sink writes the client's chunk there
  and then: no task wake-up per token. This is the path every API request takes.
- otherwise `req.waiter`, a future the loop resolves (`await engine.wait(req)`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from typing import Protocol

from flexpipe.engine.core import EngineCore, StepEvents
from flexpipe.engine.metrics import EngineMetrics
from flexpipe.engine.request import EngineRequest, Status
from flexpipe.engine.scheduler import Scheduler
from flexpipe.perf import BatchShape

log = logging.getLogger("flexpipe.engine")

MAX_PASS_S = 0.002  # time scale 0: at most this much work between two event-loop passes


class ProgressSink(Protocol):
    def on_progress(self, req: EngineRequest) -> None:
        """`req` has new tokens or has finished (called by the engine loop; must not block)."""


class Engine:
    def __init__(
        self,
        scheduler: Scheduler,
        step_time_s: Callable[[BatchShape], float],
        metrics: EngineMetrics,
        time_scale: float = 1.0,
        max_steps_per_pass: int = 8,
    ) -> None:
        self.core = EngineCore(scheduler, step_time_s)
        self.scheduler = scheduler
        self.max_steps_per_pass = max_steps_per_pass  # time scale 0 only
        self.metrics = metrics
        self.time_scale = time_scale
        self.requests: dict[str, EngineRequest] = {}  # request id -> in-flight request
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopping = False
        self._deferred: dict[str, EngineRequest] = {}  # request id -> told at the pass end
        # Sleep mode (flexpipe.engine.sleep): while `hold_new`, new requests wait here, outside
        # the core, until `resume` (vLLM queues adds while its scheduler is paused); while
        # `paused`, the loop runs no step at all.
        self.hold_new = False
        self.paused = False
        self._held: list[EngineRequest] = []

    # --- requests ------------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        self.requests[req.request_id] = req
        if self.hold_new:
            req.arrival_s = time.monotonic()
            self._held.append(req)
            return
        self.core.add(req, time.monotonic())
        self._wake.set()

    def abort(self, req: EngineRequest, reason: str = "abort") -> None:
        if req in self._held:
            self._held.remove(req)
        if self.core.abort(req, time.monotonic(), reason):
            self.metrics.observe_abort(req)
            self._notify(req)
        self.requests.pop(req.request_id, None)

    def release(self, req: EngineRequest) -> None:
        """The consumer is done with a finished request."""
        self.requests.pop(req.request_id, None)

    def _notify(self, req: EngineRequest) -> None:
        sink = req.sink
        if sink is not None:
            try:
                sink.on_progress(req)
            except Exception:
                log.exception("stream of request %s failed", req.request_id)
                if req.status is not Status.FINISHED:
                    req.sink = None
                    self.abort(req)
            return
        w = req.waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def wait(self, req: EngineRequest) -> None:
        """Until `req` has progressed (new token or finished) since the caller last looked."""
        w = asyncio.get_running_loop().create_future()
        req.waiter = w
        try:
            await w
        finally:
            req.waiter = None

    # --- sleep mode (pause, hold, resume) --------------------------------------------------
    @property
    def num_held(self) -> int:
        return len(self._held)

    def pause(self, hold_new: bool = True, stop_steps: bool = True) -> None:
        """Hold new requests outside the core; with `stop_steps`, run no step either (the step
        in flight, if any, still completes)."""
        self.hold_new = hold_new
        self.paused = stop_steps

    def resume(self) -> None:
        """Admit the held requests (with their arrival times) and step again."""
        self.hold_new = False
        self.paused = False
        held, self._held = self._held, []
        for req in held:
            self.core.add(req, req.arrival_s)
        self._wake.set()

    async def drained(self, poll_s: float = 0.001) -> None:
        """Until the core has no request left (new ones are held: see `pause`)."""
        while self.core.has_work:
            await asyncio.sleep(poll_s)

    # --- loop ----------------------------------------------------------------------------
    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        self._stopping = True
        self._wake.set()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        core = self.core
        metrics = self.metrics
        clock = time.monotonic
        cpu_clock = time.thread_time  # emit CPU vs wall: time spent waiting for a CPU
        scale = self.time_scale
        deadline = clock()
        pass_start = 0.0  # time scale 0: when this event-loop pass began
        num_pass_steps = 0  # time scale 0: steps run in this pass
        deferred = self._deferred
        while not self._stopping:
            if not core.has_work or self.paused:
                self._notify_deferred()
                self._wake.clear()
                await self._wake.wait()
                deadline = clock()
                continue
            plan = core.step(clock())
            metrics.observe_plan(plan)
            for req in plan.rejected:
                self._notify(req)
            if plan.is_empty:
                self._notify_deferred()
                if not plan.preempted and not plan.rejected:
                    self._wake.clear()
                    await self._wake.wait()
                    deadline = clock()
                continue
            if scale > 0:
                deadline += plan.duration_s * scale
                delay = deadline - clock()
                if delay > 0:
                    await asyncio.sleep(delay)
                    metrics.lag_s = 0.0
                    woke = clock()
                    metrics.wakeup_late.observe(woke - deadline)
                else:
                    metrics.lag_s = -delay
                    await asyncio.sleep(0)
                    woke = clock()
                cpu0 = cpu_clock()
                self._emit(core.complete(plan, woke))
                metrics.emit_cpu_s += cpu_clock() - cpu0
                metrics.emit_time.observe(clock() - woke)
            else:
                # nothing to wait for: run several steps per event-loop pass, each request's
                # stream told once per pass (its tokens go out in one write, one SSE event
                # per token), then let the loop read new requests and flush the sockets
                now = clock()
                if num_pass_steps == 0:
                    pass_start = now
                num_pass_steps += 1
                self._emit(core.complete(plan, now), deferred)
                if (
                    num_pass_steps >= self.max_steps_per_pass
                    or now - pass_start >= MAX_PASS_S
                    or not core.has_work
                ):
                    self._notify_deferred()
                    num_pass_steps = 0
                    await asyncio.sleep(0)

    def _notify_deferred(self) -> None:
        deferred = self._deferred
        if deferred:
            reqs = list(deferred.values())
            deferred.clear()
            for req in reqs:
                self._notify(req)

    def _emit(self, events: StepEvents, deferred: dict[str, EngineRequest] | None = None) -> None:
        """Metrics for the step's events, then tell each request's consumer (or, with
        `deferred`, collect the requests to tell at the end of the event-loop pass)."""
        self.metrics.observe_step(events)
        if deferred is not None:
            for req in events.progressed:
                deferred[req.request_id] = req
        else:
            notify = self._notify
            for req in events.progressed:
                notify(req)

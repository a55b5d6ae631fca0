"""The engine core that both clocks drive: scheduler + performance model + per-request timing.

    core.add(req, now)
    plan = core.step(now)            # what runs this step, and plan.duration_s (the model's)
    ...                              # the caller lets plan.duration_s pass, on its clock
    events = core.complete(plan, now)

Every timestamp on a request (arrival, first admission, first token, each token, finish) is
the `now` the caller passed in; the core never reads a clock. The live runner
(flexpipe.engine.runner) passes `time.monotonic()` and sleeps `duration_s x time_scale`
between the two calls; a simulator passes a virtual clock and advances it by `duration_s`.
Both get the same plans, tokens and events.

The core only produces: `StepPlan` (scheduled chunks and decodes, preemptions, first
admissions, rejections) and `StepEvents` (tokens, first tokens, inter-token gaps, finishes).
Consumers (the HTTP streams, `EngineMetrics.observe_*`, a simulator's report) read them.

A step's `now` at `complete` is when its tokens exist: a request's first token is at the end
of the step that computed its last prompt token, so on a virtual clock that starts idle at
t0, TTFT is the sum of the durations of the steps up to it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from flexpipe.engine.request import EngineRequest, Status
from flexpipe.engine.scheduler import Scheduler, StepPlan, TokenStamps
from flexpipe.perf import BatchShape


@dataclass(slots=True)
class StepEvents:
    """What one completed step produced, at `now_s`.

    Each request in `progressed` got exactly one new token this step (a request's
    `num_output_tokens` is its total so far); `first_token` and `finished` are sublists of
    it, in batch order. `itl_s` holds the gap since the previous token of each progressed
    request that already had one (vllm:inter_token_latency_seconds)."""

    now_s: float
    plan: StepPlan
    progressed: list[EngineRequest]
    first_token: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)  # finish_reason set, KV freed
    itl_s: list[float] = field(default_factory=list)


class EngineCore:
    """One engine's requests on a caller's clock (see the module docstring)."""

    def __init__(self, scheduler: Scheduler, step_time_s: Callable[[BatchShape], float]) -> None:
        self.scheduler = scheduler
        self.step_time_s = step_time_s  # the performance model's price of one batch

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    def add(self, req: EngineRequest, now: float) -> None:
        req.arrival_s = now
        self.scheduler.add(req)

    def abort(self, req: EngineRequest, now: float, reason: str = "abort") -> bool:
        """Drop `req` wherever it is; its blocks are free at once. False if it had ended."""
        if req.status is Status.FINISHED:
            return False
        self.scheduler.abort(req, reason)
        req.finished_s = now
        return True

    def step(self, now: float) -> StepPlan:
        """Plan the next step at `now`. An empty plan (nothing schedulable) has duration 0;
        requests that can never fit are in `plan.rejected`, finished ("error") at `now`."""
        plan = self.scheduler.schedule()
        for req in plan.rejected:
            req.finished_s = now
        if not plan.is_empty:
            for req in plan.admitted:
                req.scheduled_s = now
            plan.duration_s = self.step_time_s(plan.batch)
        return plan

    def complete(self, plan: StepPlan, now: float) -> StepEvents:
        """Apply `plan` as finished at `now`: computed tokens advance, requests that caught up
        get a token (stamped `now`), finished ones free their blocks. Requests aborted or
        preempted since the plan get nothing."""
        stamps = TokenStamps(now)
        out = self.scheduler.finish_step(plan, stamps)
        return StepEvents(now, plan, out, stamps.first_token, stamps.finished, stamps.itl_s)


__all__ = ["EngineCore", "StepEvents"]

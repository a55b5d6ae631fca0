"""One simulated engine instance: an `EngineCore` on the virtual clock.

The instance is either idle or running one planned step (`core.step(t)`), possibly followed
by a closed-form stretch of identical decode steps (flexpipe.sim.stretch); one event marks
the end. Whoever needs the engine's state at a time inside a stretch (an arriving request,
the gateway's scrape) first calls `sync(now)`: the steps that ended by `now` are applied and
the step in progress is re-planned where it started, exactly as stepping would have left it.
An arriving request cuts the stretch after the step in progress: the next step sees it, as
a live engine's would.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from flexpipe.engine.args import EngineConfig
from flexpipe.engine.core import EngineCore, StepEvents
from flexpipe.engine.metrics import num_queued_tokens
from flexpipe.engine.request import EngineRequest, SamplingParams, context_error
from flexpipe.engine.scheduler import StepPlan
from flexpipe.sim.colocation import Colocation
from flexpipe.sim.deployment import Deployment
from flexpipe.sim.engine_factory import engine_core
from flexpipe.sim.loop import STEP_END, EventLoop
from flexpipe.sim.request import SimRequest
from flexpipe.sim.stretch import (
    SIM_GEN_IDS,
    Stretch,
    decode_registers_blocks,
    fast_forward,
    plan_stretch,
    price,
)

MAX_STRETCH_STEPS = 1 << 20

Done = Callable[["SimInstance", SimRequest, EngineRequest, float], None]
Busy = Callable[[float, float], None]


class SimInstance:
    def __init__(
        self,
        dep: Deployment,
        cfg: EngineConfig,
        loop: EventLoop,
        on_done: Done,
        on_busy: Busy,
        stretches: bool = True,
        on_first_token: Done | None = None,
        colocation: Colocation | None = None,
    ) -> None:
        self.dep = dep
        self.cfg = cfg
        self.url = f"sim://{dep.name}"
        self.core: EngineCore = engine_core(cfg, lazy_decodes=True)
        self.loop = loop
        self.on_done = on_done  # a request finished (completed or errored) at `now`
        self.on_busy = on_busy  # the engine computed from `start_s` to `end_s`
        self.on_first_token = on_first_token  # a request's first token came at `now`
        self.max_stretch_steps = MAX_STRETCH_STEPS if stretches else 0
        # Sharing its GPU (a memory fraction): its neighbours stretch its steps
        # (sim/colocation.py). A closed-form stretch of steps assumes a fixed step time, so a
        # shared engine steps one by one.
        self.colocation = colocation if dep.gpu_memory_fraction is not None else None
        if self.colocation is not None:
            self.colocation.join(self)
            self.max_stretch_steps = 0
        self._decode_registers = decode_registers_blocks(self.core)
        self.requests: dict[str, SimRequest] = {}  # engine request id -> its sim request
        self._params_by_max_tokens: dict[int, SamplingParams] = {}
        self.num_steps = 0  # steps applied (planned and virtual)
        self.num_events = 0  # step-end events (one per stretch)
        self.busy_s = 0.0
        # the step in progress (None: idle) and the stretch that follows it
        self._plan: StepPlan | None = None
        self._start_s = 0.0
        self._first_end_s = 0.0
        self._stretch: Stretch | None = None
        self._version = 0
        # a request arrived during the step in progress: the next step will most likely be
        # cut again, so it is not worth planning a stretch (exact either way)
        self._arrived = False

    @property
    def model(self) -> str:
        return self.dep.model

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        return self.dep.gpu_ids

    @property
    def computing(self) -> bool:
        """A step is in progress (what a neighbour on its GPU is slowed by)."""
        return self._plan is not None

    # --- requests ------------------------------------------------------------------------
    @property
    def max_num_seqs(self) -> int:
        return self.core.scheduler.config.max_num_seqs

    def refusal(self, req: SimRequest) -> str:
        """Why the engine answers 400 (the API's context check), or ""."""
        why = context_error(req.num_prompt_tokens, req.num_output_tokens, self.cfg.max_model_len)
        return f"400: {why} ({self.dep.name})" if why else ""

    def submit(self, req: SimRequest, now: float) -> None:
        ereq = EngineRequest(
            str(req.request_id),
            req.prompt_token_ids(),
            self._params(req.num_output_tokens),
            req.num_output_tokens,
            SIM_GEN_IDS,
        )
        ereq.num_preloaded_tokens = min(req.num_kv_tokens, req.num_prompt_tokens - 1)
        ereq.priority = req.priority
        self.requests[ereq.request_id] = req
        self.sync(now)
        self.core.add(ereq, now)
        self._arrived = True
        if self._plan is None:
            self._start(now)
        elif self._stretch is not None:
            self._stretch = None  # the next step must see the new request
            self._schedule_end(self._first_end_s)

    def _params(self, max_tokens: int) -> SamplingParams:
        """The sampling parameters of a request of `max_tokens` (immutable: one per count)."""
        params = self._params_by_max_tokens.get(max_tokens)
        if params is None:
            params = self._params_by_max_tokens[max_tokens] = SamplingParams(max_tokens=max_tokens)
        return params

    def take(self, req: SimRequest, now: float) -> EngineRequest | None:
        """Take `req` off this engine at `now` (moved, or the engine died): aborted, its blocks
        free; the step in progress ends as planned without it. None if it had ended."""
        self.sync(now)
        rid = str(req.request_id)
        s = self.core.scheduler
        ereq = next((r for r in (*s.running, *s.waiting) if r.request_id == rid), None)
        if ereq is None or rid not in self.requests:
            return None
        if self._stretch is not None:  # the stretch assumed this request runs on
            self._stretch = None
            self._schedule_end(self._first_end_s)
        self.core.abort(ereq, now)
        del self.requests[rid]
        return ereq

    def step_end_s(self, now: float) -> float | None:
        """When the step in progress at `now` ends: its running requests' next tokens come
        then. None when idle."""
        self.sync(now)
        return None if self._plan is None else self._first_end_s

    # --- stepping ------------------------------------------------------------------------
    def sync(self, now: float) -> None:
        """Bring the engine's state to `now` inside a stretch (see the module docstring)."""
        st = self._stretch
        if st is None or now < self._first_end_s:
            return
        started = st.steps_started_by(now - self._first_end_s)
        done = started - 1  # virtual steps that ended by now
        restart_s = self._first_end_s + st.elapsed_s(done)
        self._start(restart_s, self._apply(done, restart_s))

    def _start(self, now: float, finished: list[EngineRequest] | None = None) -> None:
        """Plan the next step at `now`; then tell the gateway of the requests that ended
        (`finished` by the step before, rejected by this plan): the engine plans its next step
        before a freed slot can bring it a new request."""
        core = self.core
        ended = finished or []
        while True:
            plan = core.step(now)
            ended += plan.rejected
            if not plan.is_empty or not plan.rejected:
                break
        if not plan.is_empty:
            if self.colocation is not None:
                plan.duration_s *= self.colocation.factor(self)
            self._plan = plan
            self._start_s = now
            self._first_end_s = now + plan.duration_s
            m = 0
            if not self._arrived:
                m = plan_stretch(core, plan, self.max_stretch_steps, self._decode_registers)
            self._arrived = False
            self._stretch = price(core, plan, m) if m else None
            end = self._first_end_s + (self._stretch.elapsed_s(m) if self._stretch else 0.0)
            self._schedule_end(end)
        for req in ended:
            self._done(req, req.finished_s)

    def _schedule_end(self, end_s: float) -> None:
        self._version += 1
        self.loop.at(end_s, STEP_END, partial(self._on_end, self._version))

    def _on_end(self, version: int, now: float) -> None:
        if version != self._version:
            return  # re-planned since
        self.num_events += 1
        st = self._stretch
        self._start(now, self._apply(st.num_steps if st else 0, now))

    def _apply(self, num_virtual: int, end_s: float) -> list[EngineRequest]:
        """The planned step ended at `_first_end_s`; then `num_virtual` virtual steps ended
        at `end_s`. Returns the requests that finished."""
        plan = self._plan
        assert plan is not None
        events: StepEvents = self.core.complete(plan, self._first_end_s)
        if events.first_token and self.on_first_token is not None:
            for ereq in events.first_token:  # (a stretch only decodes: no first token in it)
                self.on_first_token(self, self.requests[ereq.request_id], ereq, events.now_s)
        if num_virtual:
            reqs = [r for r, _, _ in plan.scheduled]
            fast_forward(self.core, reqs, num_virtual, end_s)
        self.num_steps += 1 + num_virtual
        busy_end = end_s if num_virtual else self._first_end_s
        self.busy_s += busy_end - self._start_s
        self.on_busy(self._start_s, busy_end)
        self._plan = None
        self._stretch = None
        return events.finished

    def _done(self, ereq: EngineRequest, now: float) -> None:
        req = self.requests.pop(ereq.request_id)
        self.on_done(self, req, ereq, now)

    # --- what /metrics would say ---------------------------------------------------------
    def metrics(self, now: float) -> dict[str, float]:
        """What the gateway's prober reads from this engine's /metrics at `now`
        (`parse_engine_metrics`' fields, from flexpipe.engine.metrics' own values)."""
        self.sync(now)
        s = self.core.scheduler
        bm = s.bm
        return {
            "num_running": s.num_running,
            "num_waiting": s.num_waiting,
            "kv_usage": bm.usage,
            "num_tokens": num_queued_tokens(s),
            "max_num_seqs": s.config.max_num_seqs,
            "num_kv_tokens": bm.num_blocks * bm.block_size,
        }

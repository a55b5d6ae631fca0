"""The simulator's moves of requests between engines and the warm-ups of recompute moves:
what `World.move`, `World.warm_up` and `World.awaits_first_token` do, and their bookkeeping
(the continuation -> client request map, moves per request, warm-ups running, the move log);
and the simulated gateway's side of a shift's moves (`GatewayMoves`: pre-copy, cut-over,
fences)."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexpipe.control.core.shift_commands import MoveOrder
from flexpipe.engine.request import EngineRequest
from flexpipe.gateway.core.cut_over import (
    MAX_FENCE_S,
    cut_over_s,
    fence_wait_s,
    mean_gap_s,
    token_wait_s,
)
from flexpipe.gateway.core.warm_up import MOVE_PRIORITY, WARM_POLL_S, warms
from flexpipe.model_spec import ModelSpec
from flexpipe.policies.shift.migration import link_between, perf_model_of
from flexpipe.sim.gateway import SimGateway
from flexpipe.sim.loop import CONTROL, EventLoop
from flexpipe.sim.request import SimRequest

if TYPE_CHECKING:  # the simulator imports this module
    from flexpipe.sim.shift_run import World
    from flexpipe.sim.simulator import InstanceRecord

SEGMENT_ID_BASE = 1 << 40  # ids of a moved request's continuations (never an arrival's)
WARM_UP_ID_BASE = 1 << 41  # ids of the warm-ups of recompute moves (never a client's)

WarmDone = Callable[[str, float], None]


@dataclass(frozen=True, slots=True)
class MoveRecord:
    """One move of a client request off its instance: how, the warm-up's outcome (None: none
    tried), when it was cut over, the last token its source gave, the continuation (its
    first token, prefix-cache hit, ... once it ran) and the instance it left."""

    request_id: int
    method: str
    warm: str | None
    at_s: float
    last_token_s: float
    continuation: SimRequest
    source: str = ""  # the instance it left (its deployment's name)

    @property
    def pause_s(self) -> float:
        """From the source's last token to the destination's first (-1: none there)."""
        first_s = self.continuation.first_token_s
        return first_s - self.last_token_s if first_s >= 0 else -1.0


class Moves:
    """Moves and warm-ups on the run's loop and gateway. `source_emptied(t)` is scheduled
    when a move leaves its source with no request (a drain waiting for it goes on)."""

    def __init__(
        self, loop: EventLoop, gateway: SimGateway, source_emptied: Callable[[float], None]
    ) -> None:
        self.loop = loop
        self.gateway = gateway
        self._source_emptied = source_emptied
        self.roots: dict[int, SimRequest] = {}  # continuation id -> the client's request
        self.num_moves: dict[int, int] = {}  # client request id -> times moved
        self._num_segments = 0
        # engine request id -> (destination, warm-up, its move's callback): pre-copies running
        self.warming: dict[str, tuple[InstanceRecord, SimRequest, WarmDone]] = {}
        self._num_warm_ups = 0
        self.warm_ups: dict[str, int] = {}  # outcome -> warm-ups (`relay.warm_up`'s outcomes)
        self.log: list[MoveRecord] = []  # in the order they cut over

    def warm_up(
        self,
        req: SimRequest,
        source: InstanceRecord,
        target: InstanceRecord,
        timeout_s: float,
        now: float,
        done: WarmDone,
        fence_waited_s: float = 0.0,
    ) -> None:
        """The gateway's pre-copy of a recompute move (`relay.warm_up`): `target`'s engine
        gets the continuation the move will send (prompt + tokens generated so far), for one
        token, ahead of its queue, while `req` keeps generating on `source`; its blocks stay
        in the target's prefix cache when it ends. `done(outcome, t)`: "warmed" when it ended
        within `timeout_s`, "timed_out" (aborted then), "failed" (refused, or the engine
        died), "skipped" (no free slot there, nothing generated yet, no bound): then. First it
        waits while a move cuts over to `target` (`cut_over.fence_wait_s`, `MAX_FENCE_S` in
        all, `fence_waited_s` so far; not counted in `timeout_s`), as the gateway does."""
        inst = target.instance
        src = source.instance
        assert inst is not None and src is not None
        if timeout_s <= 0:  # no warm-up asked for
            self._warmed("skipped", done, now)
            return
        record = self.gateway.pool.instances.get(inst.url)
        fenced_until_s = record.fenced_until_s if record else 0.0
        wait_s = fence_wait_s(fenced_until_s, now, MAX_FENCE_S - fence_waited_s)
        if wait_s > 0:  # a move cuts over there: not into its step (`relay.warm_up`; polled)
            wait_s = min(wait_s, WARM_POLL_S)
            self.loop.at(
                now + wait_s,
                CONTROL,
                functools.partial(
                    self.warm_up,
                    req,
                    source,
                    target,
                    timeout_s,
                    done=done,
                    fence_waited_s=fence_waited_s + wait_s,
                ),
            )
            return
        rid = str(req.request_id)
        src.sync(now)  # inside a stretch: its tokens so far, as stepping would have them
        ereq = next(
            (
                r
                for r in (*src.core.scheduler.running, *src.core.scheduler.waiting)
                if r.request_id == rid
            ),
            None,
        )
        fits = record is not None and warms(timeout_s, record.num_slots, record.num_in_flight)
        if ereq is None or not fits:
            self._warmed("skipped", done, now)
            return
        src.core.scheduler.materialize(ereq)
        n = ereq.num_output_tokens
        if n == 0 or n >= req.num_output_tokens:
            self._warmed("skipped", done, now)
            return
        root = self.roots.get(req.request_id, req)
        self._num_warm_ups += 1
        warm = SimRequest(
            WARM_UP_ID_BASE + self._num_warm_ups,
            now,
            root.model,
            req.num_prompt_tokens + n,
            1,
            root.prefix_ids,
            priority=MOVE_PRIORITY,
            context_of=root,
        )
        if inst.refusal(warm):
            self._warmed("failed", done, now)
            return
        self.warming[str(warm.request_id)] = (target, warm, done)
        inst.submit(warm, now)
        self.loop.at(now + timeout_s, CONTROL, functools.partial(self._warm_up_bound, warm))

    def _warm_up_bound(self, warm: SimRequest, now: float) -> None:
        """The warm-up's bound passed: aborted on the engine if it still runs."""
        entry = self.warming.pop(str(warm.request_id), None)
        if entry is None:
            return
        target, _, done = entry
        if target.instance is not None:
            target.instance.take(warm, now)
        self._warmed("timed_out", done, now)

    def _warmed(self, outcome: str, done: WarmDone, now: float) -> None:
        self.warm_ups[outcome] = self.warm_ups.get(outcome, 0) + 1
        done(outcome, now)

    def warm_up_ended(self, ereq: EngineRequest, now: float) -> bool:
        """An engine ended `ereq`: if it was a warm-up, its move hears how (True)."""
        entry = self.warming.pop(ereq.request_id, None)
        if entry is None:
            return False
        _, _, done = entry
        self._warmed("failed" if ereq.finish_reason == "error" else "warmed", done, now)
        return True

    def target_died(self, rec: InstanceRecord, now: float) -> None:
        """`rec`'s engine died: the pre-copies to it die with it."""
        assert rec.instance is not None
        for key, (target, warm, done) in list(self.warming.items()):
            if target is rec:
                del self.warming[key]
                rec.instance.take(warm, now)
                self._warmed("failed", done, now)

    def awaits_first_token(self, rec: InstanceRecord) -> bool:
        """Whether a request on `rec` has not had its first token yet: its prompt is being
        prefilled there, or waits to be; a client's or another move's warm-up (the gateway's
        `gateway.moves.between_prefills`)."""
        inst = rec.instance
        if inst is None:
            return False
        inst.sync(self.loop.now_s)
        s = inst.core.scheduler
        return any(r.num_output_tokens == 0 for r in (*s.running, *s.waiting))

    def move(
        self,
        req: SimRequest,
        source: InstanceRecord,
        target: InstanceRecord | None,
        method: str,
        delay_s: float,
        now: float,
        warm: str | None = None,
    ) -> None:
        """Take `req` off `source` and continue it on `target` (None: wherever the gateway
        routes it) by `method`: `kv_moved` (its context arrives as KV after `delay_s`),
        `recomputed` (the target prefills prompt + output so far) or `rerun` (nothing was
        answered yet: sent again). `warm`: what became of a recompute's warm-up (None: none
        was tried), for the move log."""
        assert source.instance is not None
        ereq = source.instance.take(req, now)
        if ereq is None:
            return
        self.gateway.detach(req, now)
        root = self.roots.pop(req.request_id, req)
        self.num_moves[root.request_id] = self.num_moves.get(root.request_id, 0) + 1
        n = ereq.num_output_tokens
        if n:
            if root.first_token_s < 0:
                root.first_token_s = ereq.first_token_s
            root.last_token_s = ereq.last_token_s
            root.num_generated_tokens += n
        root.num_cached_tokens += ereq.num_cached_tokens
        root.num_preemptions += ereq.num_preemptions
        self._num_segments += 1
        seg = SimRequest(
            SEGMENT_ID_BASE + self._num_segments,
            root.arrival_s,
            root.model,
            req.num_prompt_tokens + n,
            req.num_output_tokens - n,
            root.prefix_ids,
            context_of=root,
        )
        self.log.append(
            MoveRecord(root.request_id, method, warm, now, ereq.last_token_s, seg, source.dep.name)
        )
        if method == "kv_moved":
            seg.num_kv_tokens = seg.num_prompt_tokens
        self.roots[seg.request_id] = root
        if not source.instance.requests:  # a drain waiting for it to empty goes on
            self.loop.at(now, CONTROL, self._source_emptied)
        if target is None:
            self.gateway.submit(seg, now)
            return
        seg.priority = MOVE_PRIORITY  # the controller's move: ahead of the target's queue
        url = target.instance.url if target.instance is not None else ""

        def place(t: float) -> None:
            if url in self.gateway.pool.instances and target.active:
                self.gateway.place(seg, url, t)
            else:
                self.gateway.submit(seg, t)

        if delay_s > 0:
            self.loop.at(now + delay_s, CONTROL, place)
        else:
            place(now)


def cut_over_at_s(req: SimRequest, source: InstanceRecord, now: float) -> tuple[float, float]:
    """When the gateway cuts a recompute move of `req`, asked at `now`, over
    (`gateway.moves.at_next_token`, by `gateway.cut_over.cut_over_s`): at the end of its
    source's step in progress, where its next token comes, if that is within the wait
    (`TOKEN_WAIT_GAPS` of its mean gap between tokens); else at the end of the wait. A
    continuation of an earlier move has no gap known (the gateway's failover pump keeps
    none): the wait's cap. A request not running there gets no token: the end of the wait.
    Returns that time and the wait's bound (`token_wait_s`, what the gateway fences the
    destination for: it cannot know when the token comes)."""
    inst = source.instance
    if inst is None:
        return now, 0.0
    end_s = inst.step_end_s(now)
    s = inst.core.scheduler
    rid = str(req.request_id)
    ereq = next((r for r in s.running if r.request_id == rid), None)
    if ereq is None:
        return cut_over_s(now, None, None), token_wait_s(None)
    s.materialize(ereq)
    gap_s = None
    if req.context_of is None:
        gap_s = mean_gap_s(ereq.first_token_s, ereq.last_token_s, ereq.num_output_tokens)
    return cut_over_s(now, end_s, gap_s), token_wait_s(gap_s)


class GatewayMoves:
    """The simulated gateway's side of a shift's moves (its `POST /admin/moves`): a wave of
    `MoveOrder`s carried out on `world`. A KV move continues its request on the destination
    once the KV is across (fenced until then); a recompute is pre-copied first
    (`World.warm_up`), then cut over at its source's next token (`cut_over_at_s`); a request
    that had no token yet is sent again (`rerun`). What left its instance is told to
    `on_moved(method)`; `when_cut_over(callback)` calls back once no pre-copy is under way
    (the gateway answers a wave once its moves cut over)."""

    def __init__(
        self, world: World, on_moved: Callable[[str], None], specs: Mapping[str, ModelSpec]
    ) -> None:
        self.world = world
        self.specs = specs  # model id -> spec: the KV a move carries
        self.on_moved = on_moved
        self.num_pre_copying = 0  # moves carried out, warming up, not cut over yet
        self._waiter: Callable[[float], None] | None = None

    def when_cut_over(self, callback: Callable[[float], None]) -> None:
        """`callback(t)` on the loop once no pre-copy is under way (at once: now)."""
        if self.num_pre_copying:
            self._waiter = callback
        else:
            self.world.loop.at(self.world.loop.now_s, CONTROL, callback)

    def carry(self, moves: Sequence[tuple[MoveOrder, SimRequest]], now: float) -> float:
        """One wave: each request still running on its source continues on its destination,
        ahead of its queue; returns when the last KV of the wave is across."""
        world = self.world
        end_s = now
        for m, req in moves:
            src, dst = m.source, m.destination
            if not any(r is req for r in world.requests_on(src)):
                continue  # it ended meanwhile (the gateway's "not_running")
            num_prompt, num_out = world.context_tokens(req, src)
            delay_s = 0.0
            if num_out == 0:
                method = "rerun"
            elif m.method == "kv":
                method = "kv_moved"
                link = link_between(world.cluster, src.planned, dst.planned)
                if link is not None:  # the engine imports what the context is now
                    spec = self.specs.get(dst.planned.model_id)
                    delay_s = perf_model_of(world.cluster, dst.planned, spec=spec).kv_transfer_s(
                        num_prompt + num_out, link.bandwidth_bytes_per_s, link.latency_s
                    )
                world.fence(req, dst, delay_s, now)
            else:
                self._pre_copy(req, src, dst, m.warm_timeout_s, now)
                continue
            world.move(req, src, dst, method, delay_s, now)
            self.on_moved(method)
            end_s = max(end_s, now + delay_s)
        return end_s

    def _pre_copy(
        self,
        req: SimRequest,
        src: InstanceRecord,
        dst: InstanceRecord,
        timeout_s: float,
        now: float,
    ) -> None:
        """The gateway's recompute move (`gateway.moves.move_request`): the destination
        warmed with the context (`World.warm_up`), then, warmed, at most `timeout_s` more
        until no stream there awaits its first token (`gateway.moves.between_prefills`,
        polled as the gateway does), then the cut-over; the request generates on its source
        all the while."""
        self.num_pre_copying += 1
        world = self.world
        bound_s = 0.0  # warmed: until when it waits for no prefill on the destination

        def cut_over(warm: str, t: float) -> None:
            """At its source's next token (`cut_over_at_s`), as the gateway does."""
            ran = any(r is req for r in world.requests_on(src))
            at_s = t
            if ran:  # new requests keep off the destination until it has the stream, fenced
                at_s, wait_s = cut_over_at_s(req, src, t)  # for the wait's bound, as
                world.fence(req, dst, wait_s, t)  # `gateway.moves.fence_target` does
            if at_s > t:
                world.loop.at(at_s, CONTROL, functools.partial(carried_out, warm))
            else:
                carried_out(warm, t)

        def carried_out(warm: str, t: float) -> None:
            if any(r is req for r in world.requests_on(src)):  # else it ended meanwhile
                world.move(req, src, dst, "recomputed", 0.0, t, warm)
                self.on_moved("recomputed")
            self.num_pre_copying -= 1
            if not self.num_pre_copying and self._waiter is not None:
                waiter, self._waiter = self._waiter, None
                world.loop.at(t, CONTROL, waiter)

        def between_prefills(t: float) -> None:
            if world.awaits_first_token(dst) and t < bound_s:
                world.loop.at(t + WARM_POLL_S, CONTROL, between_prefills)
            else:
                cut_over("warmed", t)

        def warmed(outcome: str, t: float) -> None:
            nonlocal bound_s
            if outcome == "warmed":
                bound_s = t + timeout_s
                between_prefills(t)
            else:
                cut_over(outcome, t)

        world.warm_up(req, src, dst, timeout_s, now, warmed)

"""The simulator's moves of requests between engines and the warm-ups of recompute moves:
what `World.move`, `World.warm_up` and `World.awaits_first_token` do, and their bookkeeping
(the continuation -> client request map, moves per request, warm-ups running, the move log)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flexpipe.engine.request import EngineRequest
from flexpipe.gateway.core.cut_over import (
    MAX_FENCE_S,
    cut_over_s,
    fence_wait_s,
    mean_gap_s,
    token_wait_s,
)
from flexpipe.gateway.relay import MOVE_PRIORITY, WARM_POLL_S, warms
from flexpipe.sim.gateway import SimGateway
from flexpipe.sim.loop import CONTROL, EventLoop
from flexpipe.sim.request import SimRequest

if TYPE_CHECKING:  # the simulator imports this module
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
            self.loop.at(now + wait_s, CONTROL, functools.partial(
                self.warm_up, req, source, target, timeout_s, done=done,
                fence_waited_s=fence_waited_s + wait_s,
            ))  # fmt: skip
            return
        rid = str(req.request_id)
        src.sync(now)  # inside a stretch: its tokens so far, as stepping would have them
        ereq = next((r for r in (*src.core.scheduler.running, *src.core.scheduler.waiting)
                     if r.request_id == rid), None)  # fmt: skip
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
            WARM_UP_ID_BASE + self._num_warm_ups, now, root.model, req.num_prompt_tokens + n, 1,
            root.prefix_ids, priority=MOVE_PRIORITY, context_of=root,
        )  # fmt: skip
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
            root.arrival_s, root.model, req.num_prompt_tokens + n, req.num_output_tokens - n,
            root.prefix_ids, context_of=root,
        )  # fmt: skip
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

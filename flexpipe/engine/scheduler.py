"""The sim engine's iteration-level scheduler: pure, steppable by hand.

`schedule()` turns the waiting and running requests into a `StepPlan` (which requests get how
many tokens this step, and the `BatchShape` the performance model prices); `finish_step(plan)`
applies it as if the GPU had run it: computed tokens advance, requests that caught up sample
a token, finished ones free their blocks. No clock, no I/O: `EngineCore` (flexpipe.engine.core)
adds the timing on the clock it is given.

Policy (vLLM V1's, with V0's admission watermark):
- Running requests first, in admission order, each getting `num_tokens - num_computed_tokens`
  tokens (1 for a decode; a chunk of its prompt otherwise) within the step's token budget
  (`max_num_batched_tokens`; chunked prefill splits a long prompt over steps).
- When a running request needs a block and none is free, the most recently admitted running
  request is preempted: its blocks are freed and it goes back to the head of the waiting queue
  to be recomputed (its cached prefix blocks may still be hit).
- Then waiting requests, FCFS, while there is budget, fewer than `max_num_seqs` running, no
  preemption happened this step, and enough free blocks remain above the watermark.
- `policy="priority"` (vLLM's `--scheduling-policy priority`): the waiting queue is ordered by
  (priority, arrival), lower first, and the preemption victim is the running request with the
  largest (priority, arrival) instead of the last admitted. flexpipe's gateway sends a request
  it moves off a drained instance with a negative priority, so that it takes the next free
  slot ahead of the queue (and is the last to be preempted).

Lazy decodes (`lazy_decodes=True`, the simulator's engines): a running request that decodes
a known token every step costs nothing per step (flexpipe.engine.lazy, `LazyDecodes`).
"""

from __future__ import annotations

import contextlib
from collections import deque
from dataclasses import dataclass, field

from flexpipe.engine.block_manager import BlockManager
from flexpipe.engine.lazy import LazyDecodes
from flexpipe.engine.request import EngineRequest, Status
from flexpipe.perf import BatchShape


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 4096
    enable_chunked_prefill: bool = True
    watermark: float = 0.01  # fraction of blocks kept free when admitting a request
    policy: str = "fcfs"  # "fcfs" | "priority" (vLLM's --scheduling-policy)


_NO_BATCH = BatchShape()


@dataclass(slots=True)
class StepPlan:
    # (request, tokens scheduled this step, tokens already computed before the step)
    scheduled: list[tuple[EngineRequest, int, int]] = field(default_factory=list)
    batch: BatchShape = _NO_BATCH  # (immutable: one shared, not one per step)
    preempted: list[EngineRequest] = field(default_factory=list)
    rejected: list[EngineRequest] = field(default_factory=list)  # can never fit: errored
    admitted: list[EngineRequest] = field(default_factory=list)  # first admissions this step
    duration_s: float = 0.0  # the performance model's time for `batch` (set by EngineCore)
    num_lazy: int = 0  # running requests decoding lazily this step (not in `scheduled`)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.num_lazy


@dataclass(slots=True)
class TokenStamps:
    """Where `finish_step` stamps the step's tokens at `now_s` when given one (the engine
    core's `StepEvents` lists, filled in the same pass over the batch): `first_token_s` or
    an inter-token gap, `last_token_s`, and `finished_s` of the requests that finished."""

    now_s: float
    first_token: list[EngineRequest] = field(default_factory=list)
    finished: list[EngineRequest] = field(default_factory=list)
    itl_s: list[float] = field(default_factory=list)


class Scheduler(LazyDecodes):
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, lazy_decodes: bool = False
    ) -> None:
        self.config = config
        self.bm = block_manager
        self.waiting: deque[EngineRequest] = deque()
        self.running: list[EngineRequest] = []
        self.num_preemptions = 0
        self._num_watermark_blocks = int(config.watermark * block_manager.num_blocks)
        self.num_steps = 0  # steps finished (`finish_step` calls)
        self._num_admissions = 0  # -> EngineRequest._run_seq
        self._init_lazy(lazy_decodes)

    # --- queue changes -------------------------------------------------------------------
    def add(self, req: EngineRequest) -> None:
        req.status = Status.WAITING
        if self.config.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.append(req)

    def _insert_by_priority(self, req: EngineRequest) -> None:
        """Before the first waiting request that comes later in (priority, arrival) order: a
        linear scan of the deque, as the queue is short next to a step's work."""
        key = (req.priority, req.arrival_s)
        for n, other in enumerate(self.waiting):
            if (other.priority, other.arrival_s) > key:
                self.waiting.insert(n, req)
                return
        self.waiting.append(req)

    def abort(self, req: EngineRequest, reason: str = "abort") -> None:
        """Drop a request wherever it is and free its blocks at once."""
        if req.status is Status.FINISHED:
            return
        if req._lazy_step >= 0:
            self._unlazy(req)
        if req.status is Status.WAITING:
            with contextlib.suppress(ValueError):
                self.waiting.remove(req)
        else:
            with contextlib.suppress(ValueError):
                self.running.remove(req)
        self.bm.free(req.kv)
        req.status = Status.FINISHED
        if req.finish_reason is None:
            req.finish_reason = reason

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # --- one step ------------------------------------------------------------------------
    def _preempt(self, req: EngineRequest) -> None:
        if req._lazy_step >= 0:
            self._unlazy(req)
        self.bm.free(req.kv)
        req.status = Status.WAITING
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        if self.config.policy == "priority":
            self._insert_by_priority(req)
        else:
            self.waiting.appendleft(req)

    def preempt_all(self) -> int:
        """Every running request back to the waiting queue, its KV blocks freed (to recompute):
        what vLLM does to running requests before a sleep drops the KV cache
        (reset_prefix_cache with reset_running_requests). Returns how many."""
        num = 0
        while self.running:
            self._preempt(self.running.pop())
            num += 1
        return num

    def _pop_victim(self) -> tuple[EngineRequest, int]:
        """The running request to preempt and where it was in `running`: the last admitted
        (FCFS), or the one latest in (priority, arrival) order (priority)."""
        running = self.running
        if self.config.policy != "priority":
            return running.pop(), len(running)
        victim = max(running, key=lambda r: (r.priority, r.arrival_s))
        pos = running.index(victim)
        del running[pos]
        return victim, pos

    def schedule(self) -> StepPlan:
        if self._num_lazy:
            lazy_plan = self._schedule_lazy()
            if lazy_plan is not None:
                return lazy_plan
        cfg = self.config
        bm = self.bm
        plan = StepPlan()
        scheduled = plan.scheduled
        budget = cfg.max_num_batched_tokens
        running = self.running

        chunked = cfg.enable_chunked_prefill
        allocate = bm.allocate
        bs = bm.block_size
        append = scheduled.append
        # the batch shape, summed as requests are scheduled (see `_batch_shape`)
        num_decode = 0
        decode_context = 0
        reshape = False  # (priority) a scheduled request was preempted: sum again at the end
        num_running = len(running)
        i = 0
        while i < num_running and budget > 0:
            req = running[i]
            before = req.num_computed_tokens
            num_new = len(req.token_ids) - before
            if num_new > budget:
                if not chunked:
                    i += 1
                    continue
                num_new = budget
            if num_new <= 0:
                i += 1
                continue
            total = before + num_new
            kv = req.kv
            num_blocks = kv.num_blocks
            if total <= num_blocks * bs:
                # `allocate`'s no-new-block case, inline (it runs for nearly every decode)
                if kv.num_cached_blocks < num_blocks:
                    kv.num_cached_blocks = num_blocks
            else:
                ok = True
                while not allocate(kv, total):
                    victim, pos = self._pop_victim()
                    num_running -= 1
                    if pos < i:  # (priority) already looked at in this step: undo its share
                        i -= 1
                        for n, (r, num, _) in enumerate(scheduled):
                            if r is victim:
                                del scheduled[n]
                                budget += num
                                reshape = True
                                break
                    self._preempt(victim)
                    plan.preempted.append(victim)
                    if victim is req:
                        ok = False
                        break
                if not ok:
                    break
            append((req, num_new, before))
            budget -= num_new
            if num_new == 1 and before >= req._num_prompt:
                num_decode += 1
                decode_context += total
            i += 1

        num_ran = len(scheduled)
        if not plan.preempted:
            self._admit(plan, budget)
        if not scheduled and not running and self.waiting:
            # nothing runs and the head cannot be admitted even with every block free
            head = self.waiting[0]
            if bm.blocks_for(head.num_tokens) > bm.num_blocks:
                self.waiting.popleft()
                head.status = Status.FINISHED
                head.finish_reason = "error"
                head.error = (
                    f"request needs {head.num_tokens} tokens of KV cache; the engine holds "
                    f"{bm.num_blocks * bm.block_size}"
                )
                plan.rejected.append(head)
        if reshape or num_decode != num_ran:
            plan.batch = _batch_shape(scheduled)  # prefill chunks (or an undone share) in it
        else:  # decodes only, then the admitted requests' first chunks
            plan.batch = _batch_shape(scheduled, num_ran, num_decode, decode_context)
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        cfg = self.config
        bm = self.bm
        waiting = self.waiting
        running = self.running
        while waiting and budget > 0 and len(running) < cfg.max_num_seqs:
            req = waiting[0]
            bm.update_hashes(req.kv, req.token_ids)
            computed = bm.computed_blocks(req.kv, req.num_tokens)
            num_computed = max(len(computed) * bm.block_size, req.num_preloaded_tokens)
            num_new = req.num_tokens - num_computed
            if num_new > budget:
                if not cfg.enable_chunked_prefill:
                    _undo_query(bm, req.num_tokens, len(computed))
                    break
                num_new = budget
            watermark = self._num_watermark_blocks if running else 0
            if not bm.allocate(req.kv, num_computed + num_new, computed, watermark):
                _undo_query(bm, req.num_tokens, len(computed))
                break
            waiting.popleft()
            running.append(req)
            self._num_admissions += 1
            req._run_seq = self._num_admissions
            req.status = Status.RUNNING
            if not req.admitted:
                req.admitted = True
                req.num_cached_tokens = len(computed) * bm.block_size
                plan.admitted.append(req)
            req.num_computed_tokens = num_computed
            plan.scheduled.append((req, num_new, num_computed))
            budget -= num_new

    def finish_step(self, plan: StepPlan, stamps: TokenStamps | None = None) -> list[EngineRequest]:
        """Apply a step the GPU has finished. Returns the requests that got a new token
        (finished ones included, with finish_reason set and blocks freed; of the lazy ones,
        only those that finished); with `stamps`, also stamps their token times (see
        `TokenStamps`)."""
        bm = self.bm
        bs = bm.block_size
        caching = bm.enable_caching
        max_model_len = self.config.max_model_len
        running_status = Status.RUNNING
        out: list[EngineRequest] = []
        out_append = out.append
        any_finished = False
        stamping = stamps is not None
        if stamps is None:
            stamps = TokenStamps(0.0)  # (not filled: only the caller's are)
        now = stamps.now_s
        first_append = stamps.first_token.append
        itl_append = stamps.itl_s.append
        finished_append = stamps.finished.append
        step = self.num_steps
        lazy = self.lazy
        # lazy requests that finish this step, merged into the batch order by place in `running`
        fin = self._finish_due
        due = self._due(fin, step + 1) if fin and fin[0][0] <= step else []
        num_due = len(due)
        n_due = 0
        due_seq = due[0]._run_seq if due else 1 << 62
        for req, num_new, before in plan.scheduled:
            while due_seq < req._run_seq:
                self._finish_lazy(due[n_due], step, out, stamps if stamping else None)
                n_due += 1
                due_seq = due[n_due]._run_seq if n_due < num_due else 1 << 62
            if req.status is not running_status or req.num_computed_tokens != before:
                continue  # aborted or preempted since the plan
            computed = before + num_new
            req.num_computed_tokens = computed
            kv = req.kv
            # (cache_full_blocks does nothing unless a block past the registered ones is full)
            if caching and computed >= (kv.num_cached_blocks + 1) * bs:
                bm.cache_full_blocks(kv, computed)
            token_ids = req.token_ids
            num_tokens = len(token_ids)
            if computed < num_tokens:
                continue  # a prefill chunk: nothing sampled yet
            plain = req._plain_token
            n_out = num_tokens - req._num_prompt + 1  # (`sample`'s count, this token included)
            if plain >= 0 and n_out < req._natural_len:
                # `req.sample()` of a one-token vocabulary before its natural end, inline
                token_ids.append(plain)
                if n_out >= req.max_output_tokens and req.finish_reason is None:
                    req.finish_reason = "length"
            else:
                req.sample()
            num_tokens += 1
            if caching and num_tokens % bs == 0:
                bm.update_hashes(kv, token_ids)
            if num_tokens >= max_model_len and req.finish_reason is None:
                req.finish_reason = "length"
            if stamping:
                if n_out == 1:  # (this token is the first)
                    req.first_token_s = now
                    first_append(req)
                else:
                    itl_append(now - req.last_token_s)
                req.last_token_s = now
            if req.finish_reason is not None:
                req.status = Status.FINISHED
                bm.free(kv)
                any_finished = True
                if stamping:
                    req.finished_s = now
                    finished_append(req)
            elif lazy and plain >= 0:
                self._lazify(req, step + 1)
            out_append(req)
        while n_due < num_due:
            self._finish_lazy(due[n_due], step, out, stamps if stamping else None)
            n_due += 1
        if any_finished:
            self.running = [r for r in self.running if r.status is Status.RUNNING]
        elif num_due:  # (only lazy requests finished: fewer than a pass over `running`)
            for req in due:
                if req.status is Status.FINISHED:
                    self.running.remove(req)
        self.num_steps = step + 1
        if stamping:
            self._last_now_s = now
        return out

    # --- lazy decodes (flexpipe.engine.lazy) ---------------------------------------------
    def _schedule_lazy(self) -> StepPlan | None:
        """`schedule` when some running requests decode lazily; None (and every request
        materialised) when the step's budget or free blocks do not cover every running
        request: the per-step path then decides who is chunked or preempted."""
        step = self.num_steps
        bm = self.bm
        bs = bm.block_size
        running = self.running
        num_lazy = self._num_lazy
        budget = self.config.max_num_batched_tokens - num_lazy
        num_need = self._block_due.get(step, 0)  # lazy requests needing a new block
        eager: list[EngineRequest] = []
        if num_lazy < len(running):
            eager = [r for r in running if r._lazy_step < 0]
            for req in eager:
                num_new = len(req.token_ids) - req.num_computed_tokens
                if num_new > 0:
                    budget -= num_new
                    total = req.num_computed_tokens + num_new
                    num_need += max(0, -(-total // bs) - req.kv.num_blocks)
        if budget < 0 or num_need > len(bm.free_queue):
            self._unlazy_all()
            return None
        # every new block comes off the head of the free queue, so the lazy ones can be
        # taken first, in one go (see flexpipe.engine.lazy)
        self._take_due_blocks(step)
        plan = StepPlan()
        scheduled = plan.scheduled
        for req in eager:  # in `running` order
            before = req.num_computed_tokens
            num_new = len(req.token_ids) - before
            if num_new <= 0:
                continue
            total = before + num_new
            kv = req.kv
            if total <= kv.num_blocks * bs:
                if kv.num_cached_blocks < kv.num_blocks:
                    kv.num_cached_blocks = kv.num_blocks
            else:
                ok = bm.allocate(kv, total)
                assert ok
            scheduled.append((req, num_new, before))
        self._admit(plan, budget)
        plan.num_lazy = num_lazy
        context = self._lazy_context + num_lazy * step  # the lazy decodes' tokens at `step`
        plan.batch = _batch_shape(scheduled, 0, num_lazy, context)
        return plan


def _undo_query(bm: BlockManager, num_tokens: int, num_hit_blocks: int) -> None:
    """A cache lookup that did not lead to admission is not counted (it will be retried)."""
    bm.stats.num_queries_tokens -= num_tokens
    bm.stats.num_hit_tokens -= num_hit_blocks * bm.block_size


def _batch_shape(
    scheduled: list[tuple[EngineRequest, int, int]],
    start: int = 0,
    num_decode: int = 0,
    decode_context: int = 0,
) -> BatchShape:
    """The shape of `scheduled[start:]` plus `num_decode` decodes of `decode_context` tokens
    already counted (`schedule` counts the running decodes as it schedules them)."""
    num_prefill_tokens = 0
    prefill_attention = 0.0
    num_prefill_seqs = 0
    for n_i in range(start, len(scheduled)):
        req, n, before = scheduled[n_i]
        if n == 1 and before >= req._num_prompt:
            num_decode += 1
            decode_context += before + 1
        else:
            num_prefill_tokens += n
            prefill_attention += n * (before + n / 2)
            num_prefill_seqs += 1
    return BatchShape(
        num_prefill_tokens=num_prefill_tokens,
        prefill_attention_tokens=prefill_attention,
        num_decode_seqs=num_decode,
        decode_context_tokens=decode_context,
        num_prefill_seqs=num_prefill_seqs,
    )

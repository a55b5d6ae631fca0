"""Closed-form decode stretches: many identical decode steps in one event, exactly.

After `core.step(t)` plans a pure decode step (every running request decodes one token; no
admission, preemption or rejection), the steps that follow schedule the same batch until
something changes: a request finishes (max_tokens or max_model_len), a new block cannot be
allocated, or a request arrives (the caller cuts the stretch). `plan_stretch` says how many
such *virtual* steps follow the planned one and what they cost; `fast_forward` applies them
to the engine's state as `core.step` + `core.complete` would have, one by one:

- tokens: the sim's requests generate from a one-token vocabulary (`SIM_GEN_IDS`) with
  max_tokens set, so every generated token is known in advance;
- blocks: the block manager's calls of a decode step (`allocate`, `cache_full_blocks`,
  `update_hashes`) are made in the same global order (step, then schedule before finish,
  then batch order), but only at the steps where one of them can change something: a new
  block, a full block to register, a block hash to add; and at the last step;
- a lazy scheduler's batch (flexpipe.engine.scheduler) advances by `Scheduler.advance`,
  which makes the same block-manager calls from its heaps;
- time: a decode step's time is affine in the batch's context length (the roofline's
  attention term is linear in it; weights, communication and overhead depend on the batch
  size only), so the durations of consecutive steps form an arithmetic progression priced by
  two calls to the performance model: `d_i = d_1 + (i - 1) x slope`.

tests/sim/test_sim_stretch.py checks all of it against stepping one step per event.
"""

from __future__ import annotations

from dataclasses import dataclass

from flexpipe.engine.core import EngineCore
from flexpipe.engine.request import EngineRequest
from flexpipe.engine.scheduler import StepPlan
from flexpipe.perf import BatchShape
from flexpipe.sim.request import GENERATED_TOKEN_ID

SIM_GEN_IDS: tuple[int, ...] = (GENERATED_TOKEN_ID,)  # the simulated model's one-token vocabulary


@dataclass(slots=True)
class Stretch:
    """`num_steps` virtual decode steps after a planned one whose batch is `num_seqs`
    sequences with `context0` context tokens in all (for the planned step)."""

    num_steps: int
    num_seqs: int
    context0: int
    first_s: float = 0.0  # duration of the first virtual step
    slope_s: float = 0.0  # each next step is this much longer

    def elapsed_s(self, i: int) -> float:
        """Time the first `i` virtual steps take."""
        return i * self.first_s + self.slope_s * (i * (i - 1) / 2)

    def steps_started_by(self, dt_s: float) -> int:
        """How many virtual steps start at or before `dt_s` after the first one starts."""
        if dt_s < 0:
            return 0
        lo, hi = 1, self.num_steps  # step i starts at elapsed_s(i - 1)
        if self.elapsed_s(hi - 1) <= dt_s:
            return hi
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.elapsed_s(mid - 1) <= dt_s:
                lo = mid
            else:
                hi = mid - 1
        return lo


def _first_new_block_step(num_tokens_after: int, block_size: int) -> int:
    """The first virtual step (1-based) that needs a new block for a request holding
    `num_tokens_after` tokens after the planned step: step i allocates for
    num_tokens_after + i - 1 tokens, a new block when that count is 1 past a block edge."""
    return (1 - num_tokens_after) % block_size + 1


def _num_new_blocks(first: int, block_size: int, num_steps: int) -> int:
    return 0 if num_steps < first else (num_steps - first) // block_size + 1


def plan_stretch(core: EngineCore, plan: StepPlan, max_steps: int, decode_registers: bool) -> int:
    """How many virtual decode steps may follow `plan` (0: none). `decode_registers` says
    whether the engine registers decode blocks in the prefix cache (then a waiting request
    could start hitting them, so with a queue the stretch stops before the first one)."""
    if (
        max_steps <= 0
        or plan.is_empty
        or plan.preempted
        or plan.admitted
        or plan.rejected
        or plan.batch.num_prefill_seqs
    ):
        return 0
    sched = core.scheduler
    if plan.num_lazy:
        return _plan_lazy_stretch(core, plan, max_steps, decode_registers)
    if len(plan.scheduled) != len(sched.running):
        return 0
    bm = sched.bm
    bs = bm.block_size
    max_len = sched.config.max_model_len
    reqs = [r for r, _, _ in plan.scheduled]
    if any(r.gen_ids is not SIM_GEN_IDS for r in reqs):
        return 0  # tokens not known in advance
    # the step (1 = the planned one) on which each request finishes (max_tokens or
    # max_model_len); virtual steps end before the first of them
    cap = min(
        max_steps,
        min(
            min(r.max_output_tokens + len(r.prompt_token_ids), max_len) - len(r.token_ids)
            for r in reqs
        )
        - 2,
    )
    if cap > 0 and decode_registers and bm.enable_caching and sched.waiting:
        # the first step whose finish registers a full block: stop before it
        cap = min(cap, min(((-len(r.token_ids)) % bs or bs) - 1 for r in reqs))
    if cap <= 0:
        return 0
    free = bm.num_free_blocks
    if len(reqs) * (cap // bs + 1) <= free:
        return cap  # even a new block per request every block_size steps fits
    # the first virtual step that needs a new block, per request (tokens after the planned step)
    return _most_steps_fitting(
        [_first_new_block_step(len(r.token_ids) + 1, bs) for r in reqs], bs, free, cap
    )


def _most_steps_fitting(firsts: list[int], block_size: int, free: int, cap: int) -> int:
    """The most virtual steps (<= cap) whose new blocks fit in `free`, given the first
    virtual step at which each request needs one."""

    def fits(m: int) -> bool:
        return sum(_num_new_blocks(f, block_size, m) for f in firsts) <= free

    if fits(cap):
        return cap
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def _plan_lazy_stretch(
    core: EngineCore, plan: StepPlan, max_steps: int, decode_registers: bool
) -> int:
    """`plan_stretch` of a batch that decodes lazily (flexpipe.engine.scheduler): the same
    bounds, from the scheduler's heaps instead of a pass over the batch."""
    sched = core.scheduler
    running = sched.running
    if plan.scheduled or plan.num_lazy != len(running):
        return 0
    step = sched.num_steps  # the planned step's
    bm = sched.bm
    bs = bm.block_size
    # virtual steps end before the first finish
    cap = min(max_steps, sched.first_lazy_finish_step() - step - 1)
    if cap > 0 and decode_registers and bm.enable_caching and sched.waiting:
        for r in running:
            sched.materialize(r)
        cap = min(cap, min(((-len(r.token_ids)) % bs or bs) - 1 for r in running))
    if cap <= 0:
        return 0
    free = bm.num_free_blocks
    if len(running) * (cap // bs + 1) <= free:
        return cap
    # (virtual step i is step + i)
    if sched.lazy_blocks_needed(step + 1, cap) <= free:
        return cap
    lo, hi = 0, cap
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sched.lazy_blocks_needed(step + 1, mid) <= free:
            lo = mid
        else:
            hi = mid - 1
    return lo


def price(core: EngineCore, plan: StepPlan, num_steps: int) -> Stretch:
    """The durations of `num_steps` virtual steps after `plan` (two performance-model calls)."""
    b = plan.batch.num_decode_seqs
    c0 = plan.batch.decode_context_tokens
    st = Stretch(num_steps, b, c0)
    step_time = core.step_time_s
    st.first_s = step_time(BatchShape(num_decode_seqs=b, decode_context_tokens=c0 + b))
    if num_steps > 1:
        second = step_time(BatchShape(num_decode_seqs=b, decode_context_tokens=c0 + 2 * b))
        st.slope_s = second - st.first_s
    return st


def fast_forward(core: EngineCore, reqs: list[EngineRequest], num_steps: int, now: float) -> None:
    """Apply `num_steps` virtual decode steps to `reqs` (the batch, in batch order, each just
    past the planned step; empty when it decodes lazily); the last one ends at `now`."""
    if num_steps <= 0:
        return
    if not reqs:
        core.scheduler.advance(num_steps, now)
        return
    bm = core.scheduler.bm
    bs = bm.block_size
    caching = bm.enable_caching
    tok = SIM_GEN_IDS[0]
    # (step, phase, batch position): phase 0 = schedule (allocate), 1 = finish
    todo: list[tuple[int, int, int]] = []
    for pos, req in enumerate(reqs):
        a = req.num_tokens
        steps = {num_steps}
        i = (1 - a) % bs + 1  # new block
        while i <= num_steps:
            steps.add(i)
            i += bs
        if caching:
            for first in ((1 - a) % bs or bs, (-a) % bs or bs):  # full block, block hash
                i = first
                while i <= num_steps:
                    steps.add(i)
                    i += bs
        todo.extend((i, 0, pos) for i in steps)
        todo.extend((i, 1, pos) for i in steps)
    todo.sort()
    base = [r.num_tokens for r in reqs]
    for i, phase, pos in todo:
        req = reqs[pos]
        total = base[pos] + i - 1  # tokens computed once step i is done
        if phase == 0:
            ok = bm.allocate(req.kv, total)
            assert ok, "a stretch step ran out of blocks (plan_stretch must prevent it)"
            continue
        if len(req.token_ids) < total:
            req.token_ids.extend([tok] * (total - len(req.token_ids)))
        req.num_computed_tokens = total
        if caching and total >= bs:
            bm.cache_full_blocks(req.kv, total)
        req.token_ids.append(tok)  # the step's sampled token
        if caching and (total + 1) % bs == 0:
            bm.update_hashes(req.kv, req.token_ids)
    for pos, req in enumerate(reqs):
        end = base[pos] + num_steps
        if len(req.token_ids) < end:
            req.token_ids.extend([tok] * (end - len(req.token_ids)))
        req.num_computed_tokens = end - 1
        req.last_token_s = now


def decode_registers_blocks(core: EngineCore) -> bool:
    """Whether this engine registers a decoding request's full blocks in the prefix cache
    (probed once on a scratch engine of the same classes)."""
    from flexpipe.engine.block_manager import BlockManager
    from flexpipe.engine.request import SamplingParams
    from flexpipe.engine.scheduler import Scheduler

    sched = core.scheduler
    bs = sched.bm.block_size
    bm = BlockManager(16, bs, True)
    scratch = Scheduler(sched.config, bm)
    req = EngineRequest(
        "probe", list(range(bs + 1)), SamplingParams(max_tokens=3 * bs), 3 * bs, SIM_GEN_IDS
    )
    scratch.add(req)
    while req.num_output_tokens < 2 * bs:
        scratch.finish_step(scratch.schedule())
    return len(bm.cached) > 1

"""Lazy decodes (flexpipe.engine.scheduler) against the per-step scheduler, step by step.

Two engine cores get the same requests, aborts and clocks; one accounts decodes lazily. After
every step they must agree exactly: the plan's batch shape, who finished and when, and the
block manager's every block (free-queue order, prefix-cache entries, reference counts), and
each request's tokens, blocks and hashes once materialised. The workloads are small KV caches
with shared prefixes, so chunked prefill, preemption, cache hits and evictions all happen.
"""

from __future__ import annotations

import random

import pytest

from flexpipe.engine.block_manager import BlockManager
from flexpipe.engine.core import EngineCore
from flexpipe.engine.request import EngineRequest, SamplingParams
from flexpipe.engine.scheduler import Scheduler, SchedulerConfig
from flexpipe.perf import perf_model_for
from flexpipe.sim.stretch import SIM_GEN_IDS

PM = perf_model_for("llama-2-7b")


def _core(lazy: bool, num_blocks: int, policy: str, caching: bool = True) -> EngineCore:
    cfg = SchedulerConfig(max_num_seqs=24, max_num_batched_tokens=256, max_model_len=700,
                          policy=policy)  # fmt: skip
    return EngineCore(Scheduler(cfg, BlockManager(num_blocks, 8, caching), lazy), PM.step_time_s)


def _requests(seed: int) -> list[tuple[int, EngineRequest]]:
    """(arrival step, request): prompts from 4 shared prefixes, some longer than a step's
    token budget (chunked while others decode), some outputs reaching max_model_len, a few
    without max_tokens' one-token fast path (a stop token)."""
    rng = random.Random(seed)
    out = []
    for i in range(90):
        prefix = list(range(1000 * rng.randrange(4), 1000 * rng.randrange(4) + 40))
        num_unique = rng.randrange(1, 200) if i % 6 else rng.randrange(400, 600)  # > budget
        prompt = prefix[: rng.randrange(0, 41)] + [rng.randrange(5, 900) for _ in range(
            num_unique)]  # fmt: skip
        max_out = rng.choice([1, 2, 9, 40, 150, 600])
        max_out = min(max_out, 700 - len(prompt))
        stop = (7,) if i % 11 == 0 else ()
        req = EngineRequest(str(i), prompt, SamplingParams(max_tokens=max_out, stop_token_ids=stop),
                            max_out, SIM_GEN_IDS)  # fmt: skip
        req.priority = rng.choice([0, 0, 0, -1])
        out.append((rng.randrange(0, 400), req))
    return sorted(out, key=lambda x: x[0])


def _copy(req: EngineRequest) -> EngineRequest:
    twin = EngineRequest(req.request_id, list(req.prompt_token_ids), req.params,
                         req.max_output_tokens, req.gen_ids)  # fmt: skip
    twin.priority = req.priority
    return twin


def _state(core: EngineCore) -> tuple[object, ...]:
    s = core.scheduler
    bm = s.bm
    reqs = []
    for r in (*s.running, *s.waiting):
        s.materialize(r)
        # (kv.num_cached_blocks is not kept for a lazy decode: `schedule` sets it before
        # anything reads it)
        reqs.append((r.request_id, r.status, len(r.token_ids), r.token_ids[-2:],
                     r.num_computed_tokens, r.kv.describe(), list(s.bm.block_hashes(r.kv)),
                     r.last_token_s))  # fmt: skip
    return (reqs, bm.free_entries(), bm.cached, bm.stats, s.num_preemptions)


@pytest.mark.parametrize(("policy", "num_blocks", "caching", "seed"), [
    ("fcfs", 60, True, 1), ("priority", 60, True, 2), ("priority", 200, True, 3),
    ("fcfs", 45, False, 4),
])  # fmt: skip
def test_lazy_decodes_equal_per_step_decodes(
    policy: str, num_blocks: int, caching: bool, seed: int
) -> None:
    eager, lazy = (
        _core(False, num_blocks, policy, caching),
        _core(True, num_blocks, policy, caching),
    )
    assert lazy.scheduler.lazy and not eager.scheduler.lazy
    todo = _requests(seed)
    twins = {r.request_id: _copy(r) for _, r in todo}
    rng = random.Random(seed)
    t = 0.0
    num_lazy_steps = num_preempted = 0
    for step in range(2000):
        while todo and todo[0][0] <= step:
            _, req = todo.pop(0)
            eager.add(req, t)
            lazy.add(twins[req.request_id], t)
        pe, pl = eager.step(t), lazy.step(t)
        assert pe.batch == pl.batch
        assert pe.duration_s == pl.duration_s
        assert [r.request_id for r in pe.preempted] == [r.request_id for r in pl.preempted]
        assert [r.request_id for r in pe.admitted] == [r.request_id for r in pl.admitted]
        num_lazy_steps += pl.num_lazy > 0
        num_preempted += len(pe.preempted)
        if step % 37 == 5 and eager.scheduler.running:  # abort a running request mid-step
            victim = rng.choice(eager.scheduler.running).request_id
            for core in (eager, lazy):
                core.abort(next(r for r in core.scheduler.running if r.request_id == victim), t)
        t += pe.duration_s
        ee, el = eager.complete(pe, t), lazy.complete(pl, t)
        assert [r.request_id for r in ee.finished] == [r.request_id for r in el.finished]
        for a, b in zip(ee.finished, el.finished, strict=True):
            assert (a.token_ids, a.finish_reason, a.last_token_s, a.finished_s) == (
                b.token_ids,
                b.finish_reason,
                b.last_token_s,
                b.finished_s,
            )
        if step % 5 == 0 or ee.finished or pe.preempted:
            assert _state(eager) == _state(lazy)
        if not todo and not eager.has_work:
            break
    assert not todo and not eager.has_work and not lazy.has_work
    assert num_lazy_steps > 100
    assert lazy.scheduler.num_steps == eager.scheduler.num_steps
    if num_blocks < 100:
        assert num_preempted > 0
